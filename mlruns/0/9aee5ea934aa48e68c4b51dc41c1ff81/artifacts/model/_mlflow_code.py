"""The code of sparknet's MLflow model (MLflow's "models from code"): MLflow runs this file to build the model
when it loads one, so nothing in the logged model is a pickle (:mod:`sparknet.mlflow_model`)."""

from mlflow.models import set_model

from sparknet.mlflow_model import SparkNetPyfunc

set_model(SparkNetPyfunc())
