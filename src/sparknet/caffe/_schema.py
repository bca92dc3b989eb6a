"""Caffe's protobuf schema (package ``caffe``), built at import time without ``protoc``.

The field names, numbers, types and defaults follow BVLC Caffe's ``caffe.proto`` so that
text prototxt files parse and binary ``.caffemodel`` / ``.binaryproto`` files read and
write byte-compatibly. Only BVLC's own messages are described (no fork extensions).

The schema is written in a small line format: a message's name on a line of its own, then its fields,
indented, one a line::

    <opt|rep|req> <type> <name> <number> [default=<value>] [packed]

and turned into a ``FileDescriptorProto`` in a private ``DescriptorPool``, so it never
clashes with another ``caffe_pb2`` a user may have imported.
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["NetParameter", "LayerParameter", "V1LayerParameter", "SolverParameter", "BlobProto", "FillerParameter",
           "V1_TYPE_NAMES", "message_class"]

_PACKAGE = "caffe"

# V1's LayerType enum, each value with the type string of the current format: NAME=number:Type.
_V1_LAYER_TYPES = (
    "NONE=0: ABSVAL=35:AbsVal ACCURACY=1:Accuracy ARGMAX=30:ArgMax BNLL=2:BNLL CONCAT=3:Concat "
    "CONTRASTIVE_LOSS=37:ContrastiveLoss CONVOLUTION=4:Convolution DATA=5:Data DECONVOLUTION=39:Deconvolution "
    "DROPOUT=6:Dropout DUMMY_DATA=32:DummyData EUCLIDEAN_LOSS=7:EuclideanLoss ELTWISE=25:Eltwise EXP=38:Exp "
    "FLATTEN=8:Flatten HDF5_DATA=9:HDF5Data HDF5_OUTPUT=10:HDF5Output HINGE_LOSS=28:HingeLoss "
    "IM2COL=11:Im2col IMAGE_DATA=12:ImageData INFOGAIN_LOSS=13:InfogainLoss INNER_PRODUCT=14:InnerProduct "
    "LRN=15:LRN MEMORY_DATA=29:MemoryData MULTINOMIAL_LOGISTIC_LOSS=16:MultinomialLogisticLoss MVN=34:MVN "
    "POOLING=17:Pooling POWER=26:Power RELU=18:ReLU SIGMOID=19:Sigmoid "
    "SIGMOID_CROSS_ENTROPY_LOSS=27:SigmoidCrossEntropyLoss SILENCE=36:Silence SOFTMAX=20:Softmax "
    "SOFTMAX_LOSS=21:SoftmaxWithLoss SPLIT=22:Split SLICE=33:Slice TANH=23:TanH WINDOW_DATA=24:WindowData "
    "THRESHOLD=31:Threshold"
)
V1_TYPE_NAMES = {int(item.split("=")[1].split(":")[0]): item.split(":")[1] for item in _V1_LAYER_TYPES.split()}
"""V1 ``LayerType`` number -> the current format's type string (``4`` -> ``"Convolution"``)."""

# Enums: qualified name ("Message.Enum" when nested) -> "NAME=number ..." (or "NAME=number:Type ...").
_ENUMS: dict[str, str] = {
    "Phase": "TRAIN=0 TEST=1",
    "FillerParameter.VarianceNorm": "FAN_IN=0 FAN_OUT=1 AVERAGE=2",
    "SolverParameter.SnapshotFormat": "HDF5=0 BINARYPROTO=1",
    "SolverParameter.SolverMode": "CPU=0 GPU=1",
    "SolverParameter.SolverType": "SGD=0 NESTEROV=1 ADAGRAD=2 RMSPROP=3 ADADELTA=4 ADAM=5",
    "LossParameter.NormalizationMode": "FULL=0 VALID=1 BATCH_SIZE=2 NONE=3",
    "DataParameter.DB": "LEVELDB=0 LMDB=1",
    "EltwiseParameter.EltwiseOp": "PROD=0 SUM=1 MAX=2",
    "HingeLossParameter.Norm": "L1=1 L2=2",
    "LRNParameter.NormRegion": "ACROSS_CHANNELS=0 WITHIN_CHANNEL=1",
    "PoolingParameter.RoundMode": "CEIL=0 FLOOR=1",
    "ReductionParameter.ReductionOp": "SUM=1 ASUM=2 SUMSQ=3 MEAN=4",
    "V1LayerParameter.LayerType": _V1_LAYER_TYPES,
}
_ENUMS.update({f"{owner}.Engine": "DEFAULT=0 CAFFE=1 CUDNN=2" for owner in (
    "ConvolutionParameter", "LRNParameter", "PoolingParameter", "ReLUParameter", "SigmoidParameter",
    "SoftmaxParameter", "TanHParameter", "SPPParameter")})
_ENUMS.update({f"{owner}.PoolMethod": "MAX=0 AVE=1 STOCHASTIC=2"
               for owner in ("PoolingParameter", "SPPParameter", "V0LayerParameter")})
_ENUMS.update({f"{owner}.DimCheckMode": "STRICT=0 PERMISSIVE=1" for owner in ("ParamSpec", "V1LayerParameter")})

# Messages, each a line with its name and then its fields, indented; the pool resolves the types once the whole
# file is added, so the order does not matter. Read into name -> its field lines.
_MESSAGES: dict[str, str] = dict(re.findall(r"^(\w+)\n((?: +.+\n)+)", """
BlobShape
    rep int64 dim 1 packed
BlobProto
    opt BlobShape shape 7
    rep float data 5 packed
    rep float diff 6 packed
    rep double double_data 8 packed
    rep double double_diff 9 packed
    opt int32 num 1 default=0
    opt int32 channels 2 default=0
    opt int32 height 3 default=0
    opt int32 width 4 default=0
FillerParameter
    opt string type 1 default=constant
    opt float value 2 default=0
    opt float min 3 default=0
    opt float max 4 default=1
    opt float mean 5 default=0
    opt float std 6 default=1
    opt int32 sparse 7 default=-1
    opt VarianceNorm variance_norm 8 default=FAN_IN
NetParameter
    opt string name 1
    rep string input 3
    rep BlobShape input_shape 8
    rep int32 input_dim 4
    opt bool force_backward 5 default=false
    opt NetState state 6
    opt bool debug_info 7 default=false
    rep LayerParameter layer 100
    rep V1LayerParameter layers 2
SolverParameter
    opt string net 24
    opt NetParameter net_param 25
    opt string train_net 1
    rep string test_net 2
    opt NetParameter train_net_param 21
    rep NetParameter test_net_param 22
    opt NetState train_state 26
    rep NetState test_state 27
    rep int32 test_iter 3
    opt int32 test_interval 4 default=0
    opt bool test_compute_loss 19 default=false
    opt bool test_initialization 32 default=true
    opt float base_lr 5
    opt int32 display 6
    opt int32 average_loss 33 default=1
    opt int32 max_iter 7
    opt int32 iter_size 36 default=1
    opt string lr_policy 8
    opt float gamma 9
    opt float power 10
    opt float momentum 11
    opt float weight_decay 12
    opt string regularization_type 29 default=L2
    opt int32 stepsize 13
    rep int32 stepvalue 34
    opt float clip_gradients 35 default=-1
    opt int32 snapshot 14 default=0
    opt string snapshot_prefix 15
    opt bool snapshot_diff 16 default=false
    opt SnapshotFormat snapshot_format 37 default=BINARYPROTO
    opt SolverMode solver_mode 17 default=GPU
    opt int32 device_id 18 default=0
    opt int64 random_seed 20 default=-1
    opt string type 40 default=SGD
    opt float delta 31 default=1e-8
    opt float momentum2 39 default=0.999
    opt float rms_decay 38 default=0.99
    opt bool debug_info 23 default=false
    opt bool snapshot_after_train 28 default=true
    opt SolverType solver_type 30 default=SGD
    opt bool layer_wise_reduce 41 default=true
    rep string weights 42
NetState
    opt Phase phase 1 default=TEST
    opt int32 level 2 default=0
    rep string stage 3
NetStateRule
    opt Phase phase 1
    opt int32 min_level 2
    opt int32 max_level 3
    rep string stage 4
    rep string not_stage 5
ParamSpec
    opt string name 1
    opt DimCheckMode share_mode 2
    opt float lr_mult 3 default=1
    opt float decay_mult 4 default=1
LayerParameter
    opt string name 1
    opt string type 2
    rep string bottom 3
    rep string top 4
    opt Phase phase 10
    rep float loss_weight 5
    rep ParamSpec param 6
    rep BlobProto blobs 7
    rep bool propagate_down 11
    rep NetStateRule include 8
    rep NetStateRule exclude 9
    opt TransformationParameter transform_param 100
    opt LossParameter loss_param 101
    opt AccuracyParameter accuracy_param 102
    opt ArgMaxParameter argmax_param 103
    opt BatchNormParameter batch_norm_param 139
    opt BiasParameter bias_param 141
    opt ClipParameter clip_param 148
    opt ConcatParameter concat_param 104
    opt ContrastiveLossParameter contrastive_loss_param 105
    opt ConvolutionParameter convolution_param 106
    opt CropParameter crop_param 144
    opt DataParameter data_param 107
    opt DropoutParameter dropout_param 108
    opt DummyDataParameter dummy_data_param 109
    opt EltwiseParameter eltwise_param 110
    opt ELUParameter elu_param 140
    opt EmbedParameter embed_param 137
    opt ExpParameter exp_param 111
    opt FlattenParameter flatten_param 135
    opt HDF5DataParameter hdf5_data_param 112
    opt HDF5OutputParameter hdf5_output_param 113
    opt HingeLossParameter hinge_loss_param 114
    opt ImageDataParameter image_data_param 115
    opt InfogainLossParameter infogain_loss_param 116
    opt InnerProductParameter inner_product_param 117
    opt InputParameter input_param 143
    opt LogParameter log_param 134
    opt LRNParameter lrn_param 118
    opt MemoryDataParameter memory_data_param 119
    opt MVNParameter mvn_param 120
    opt ParameterParameter parameter_param 145
    opt PoolingParameter pooling_param 121
    opt PowerParameter power_param 122
    opt PReLUParameter prelu_param 131
    opt PythonParameter python_param 130
    opt RecurrentParameter recurrent_param 146
    opt ReductionParameter reduction_param 136
    opt ReLUParameter relu_param 123
    opt ReshapeParameter reshape_param 133
    opt ScaleParameter scale_param 142
    opt SigmoidParameter sigmoid_param 124
    opt SoftmaxParameter softmax_param 125
    opt SPPParameter spp_param 132
    opt SliceParameter slice_param 126
    opt SwishParameter swish_param 147
    opt TanHParameter tanh_param 127
    opt ThresholdParameter threshold_param 128
    opt TileParameter tile_param 138
    opt WindowDataParameter window_data_param 129
TransformationParameter
    opt float scale 1 default=1
    opt bool mirror 2 default=false
    opt uint32 crop_size 3 default=0
    opt string mean_file 4
    rep float mean_value 5
    opt bool force_color 6 default=false
    opt bool force_gray 7 default=false
LossParameter
    opt int32 ignore_label 1
    opt NormalizationMode normalization 3 default=VALID
    opt bool normalize 2
AccuracyParameter
    opt uint32 top_k 1 default=1
    opt int32 axis 2 default=1
    opt int32 ignore_label 3
ArgMaxParameter
    opt bool out_max_val 1 default=false
    opt uint32 top_k 2 default=1
    opt int32 axis 3
ClipParameter
    opt float min 1
    opt float max 2
ConcatParameter
    opt int32 axis 2 default=1
    opt uint32 concat_dim 1 default=1
BatchNormParameter
    opt bool use_global_stats 1
    opt float moving_average_fraction 2 default=0.999
    opt float eps 3 default=1e-5
BiasParameter
    opt int32 axis 1 default=1
    opt int32 num_axes 2 default=1
    opt FillerParameter filler 3
ContrastiveLossParameter
    opt float margin 1 default=1
    opt bool legacy_version 2 default=false
ConvolutionParameter
    opt uint32 num_output 1
    opt bool bias_term 2 default=true
    rep uint32 pad 3
    rep uint32 kernel_size 4
    rep uint32 stride 6
    rep uint32 dilation 18
    opt uint32 pad_h 9 default=0
    opt uint32 pad_w 10 default=0
    opt uint32 kernel_h 11
    opt uint32 kernel_w 12
    opt uint32 stride_h 13
    opt uint32 stride_w 14
    opt uint32 group 5 default=1
    opt FillerParameter weight_filler 7
    opt FillerParameter bias_filler 8
    opt Engine engine 15 default=DEFAULT
    opt int32 axis 16 default=1
    opt bool force_nd_im2col 17 default=false
CropParameter
    opt int32 axis 1 default=2
    rep uint32 offset 2
DataParameter
    opt string source 1
    opt uint32 batch_size 4
    opt uint32 rand_skip 7 default=0
    opt DB backend 8 default=LEVELDB
    opt float scale 2 default=1
    opt string mean_file 3
    opt uint32 crop_size 5 default=0
    opt bool mirror 6 default=false
    opt bool force_encoded_color 9 default=false
    opt uint32 prefetch 10 default=4
DropoutParameter
    opt float dropout_ratio 1 default=0.5
DummyDataParameter
    rep FillerParameter data_filler 1
    rep BlobShape shape 6
    rep uint32 num 2
    rep uint32 channels 3
    rep uint32 height 4
    rep uint32 width 5
EltwiseParameter
    opt EltwiseOp operation 1 default=SUM
    rep float coeff 2
    opt bool stable_prod_grad 3 default=true
ELUParameter
    opt float alpha 1 default=1
EmbedParameter
    opt uint32 num_output 1
    opt uint32 input_dim 2
    opt bool bias_term 3 default=true
    opt FillerParameter weight_filler 4
    opt FillerParameter bias_filler 5
ExpParameter
    opt float base 1 default=-1
    opt float scale 2 default=1
    opt float shift 3 default=0
FlattenParameter
    opt int32 axis 1 default=1
    opt int32 end_axis 2 default=-1
HDF5DataParameter
    opt string source 1
    opt uint32 batch_size 2
    opt bool shuffle 3 default=false
HDF5OutputParameter
    opt string file_name 1
HingeLossParameter
    opt Norm norm 1 default=L1
ImageDataParameter
    opt string source 1
    opt uint32 batch_size 4 default=1
    opt uint32 rand_skip 7 default=0
    opt bool shuffle 8 default=false
    opt uint32 new_height 9 default=0
    opt uint32 new_width 10 default=0
    opt bool is_color 11 default=true
    opt float scale 2 default=1
    opt string mean_file 3
    opt uint32 crop_size 5 default=0
    opt bool mirror 6 default=false
    opt string root_folder 12 default=
InfogainLossParameter
    opt string source 1
    opt int32 axis 2 default=1
InnerProductParameter
    opt uint32 num_output 1
    opt bool bias_term 2 default=true
    opt FillerParameter weight_filler 3
    opt FillerParameter bias_filler 4
    opt int32 axis 5 default=1
    opt bool transpose 6 default=false
InputParameter
    rep BlobShape shape 1
LRNParameter
    opt uint32 local_size 1 default=5
    opt float alpha 2 default=1
    opt float beta 3 default=0.75
    opt NormRegion norm_region 4 default=ACROSS_CHANNELS
    opt float k 5 default=1
    opt Engine engine 6 default=DEFAULT
MemoryDataParameter
    opt uint32 batch_size 1
    opt uint32 channels 2
    opt uint32 height 3
    opt uint32 width 4
MVNParameter
    opt bool normalize_variance 1 default=true
    opt bool across_channels 2 default=false
    opt float eps 3 default=1e-9
ParameterParameter
    opt BlobShape shape 1
PoolingParameter
    opt PoolMethod pool 1 default=MAX
    opt uint32 pad 4 default=0
    opt uint32 pad_h 9 default=0
    opt uint32 pad_w 10 default=0
    opt uint32 kernel_size 2
    opt uint32 kernel_h 5
    opt uint32 kernel_w 6
    opt uint32 stride 3 default=1
    opt uint32 stride_h 7
    opt uint32 stride_w 8
    opt Engine engine 11 default=DEFAULT
    opt bool global_pooling 12 default=false
    opt RoundMode round_mode 13 default=CEIL
PowerParameter
    opt float power 1 default=1
    opt float scale 2 default=1
    opt float shift 3 default=0
PythonParameter
    opt string module 1
    opt string layer 2
    opt string param_str 3 default=
    opt bool share_in_parallel 4 default=false
RecurrentParameter
    opt uint32 num_output 1 default=0
    opt FillerParameter weight_filler 2
    opt FillerParameter bias_filler 3
    opt bool debug_info 4 default=false
    opt bool expose_hidden 5 default=false
ReductionParameter
    opt ReductionOp operation 1 default=SUM
    opt int32 axis 2 default=0
    opt float coeff 3 default=1
ReLUParameter
    opt float negative_slope 1 default=0
    opt Engine engine 2 default=DEFAULT
ReshapeParameter
    opt BlobShape shape 1
    opt int32 axis 2 default=0
    opt int32 num_axes 3 default=-1
ScaleParameter
    opt int32 axis 1 default=1
    opt int32 num_axes 2 default=1
    opt FillerParameter filler 3
    opt bool bias_term 4 default=false
    opt FillerParameter bias_filler 5
SigmoidParameter
    opt Engine engine 1 default=DEFAULT
SliceParameter
    opt int32 axis 3 default=1
    rep uint32 slice_point 2
    opt uint32 slice_dim 1 default=1
SoftmaxParameter
    opt Engine engine 1 default=DEFAULT
    opt int32 axis 2 default=1
SwishParameter
    opt float beta 1 default=1
TanHParameter
    opt Engine engine 1 default=DEFAULT
TileParameter
    opt int32 axis 1 default=1
    opt int32 tiles 2
ThresholdParameter
    opt float threshold 1 default=0
WindowDataParameter
    opt string source 1
    opt float scale 2 default=1
    opt string mean_file 3
    opt uint32 batch_size 4
    opt uint32 crop_size 5 default=0
    opt bool mirror 6 default=false
    opt float fg_threshold 7 default=0.5
    opt float bg_threshold 8 default=0.5
    opt float fg_fraction 9 default=0.25
    opt uint32 context_pad 10 default=0
    opt string crop_mode 11 default=warp
    opt bool cache_images 12 default=false
    opt string root_folder 13 default=
SPPParameter
    opt uint32 pyramid_height 1
    opt PoolMethod pool 2 default=MAX
    opt Engine engine 6 default=DEFAULT
PReLUParameter
    opt FillerParameter filler 1
    opt bool channel_shared 2 default=false
V1LayerParameter
    rep string bottom 2
    rep string top 3
    opt string name 4
    rep NetStateRule include 32
    rep NetStateRule exclude 33
    opt LayerType type 5
    rep BlobProto blobs 6
    rep string param 1001
    rep DimCheckMode blob_share_mode 1002
    rep float blobs_lr 7
    rep float weight_decay 8
    rep float loss_weight 35
    opt AccuracyParameter accuracy_param 27
    opt ArgMaxParameter argmax_param 23
    opt ConcatParameter concat_param 9
    opt ContrastiveLossParameter contrastive_loss_param 40
    opt ConvolutionParameter convolution_param 10
    opt DataParameter data_param 11
    opt DropoutParameter dropout_param 12
    opt DummyDataParameter dummy_data_param 26
    opt EltwiseParameter eltwise_param 24
    opt ExpParameter exp_param 41
    opt HDF5DataParameter hdf5_data_param 13
    opt HDF5OutputParameter hdf5_output_param 14
    opt HingeLossParameter hinge_loss_param 29
    opt ImageDataParameter image_data_param 15
    opt InfogainLossParameter infogain_loss_param 16
    opt InnerProductParameter inner_product_param 17
    opt LRNParameter lrn_param 18
    opt MemoryDataParameter memory_data_param 22
    opt MVNParameter mvn_param 34
    opt PoolingParameter pooling_param 19
    opt PowerParameter power_param 21
    opt ReLUParameter relu_param 30
    opt SigmoidParameter sigmoid_param 38
    opt SoftmaxParameter softmax_param 39
    opt SliceParameter slice_param 31
    opt TanHParameter tanh_param 37
    opt ThresholdParameter threshold_param 25
    opt WindowDataParameter window_data_param 20
    opt TransformationParameter transform_param 36
    opt LossParameter loss_param 42
    opt V0LayerParameter layer 1
V0LayerParameter
    opt string name 1
    opt string type 2
    opt uint32 num_output 3
    opt bool biasterm 4 default=true
    opt FillerParameter weight_filler 5
    opt FillerParameter bias_filler 6
    opt uint32 pad 7 default=0
    opt uint32 kernelsize 8
    opt uint32 group 9 default=1
    opt uint32 stride 10 default=1
    opt PoolMethod pool 11 default=MAX
    opt float dropout_ratio 12 default=0.5
    opt uint32 local_size 13 default=5
    opt float alpha 14 default=1
    opt float beta 15 default=0.75
    opt float k 22 default=1
    opt string source 16
    opt float scale 17 default=1
    opt string meanfile 18
    opt uint32 batchsize 19
    opt uint32 cropsize 20 default=0
    opt bool mirror 21 default=false
    rep BlobProto blobs 50
    rep float blobs_lr 51
    rep float weight_decay 52
    opt uint32 rand_skip 53 default=0
    opt float det_fg_threshold 54 default=0.5
    opt float det_bg_threshold 55 default=0.5
    opt float det_fg_fraction 56 default=0.25
    opt uint32 det_context_pad 58 default=0
    opt string det_crop_mode 59 default=warp
    opt int32 new_num 60 default=0
    opt int32 new_channels 61 default=0
    opt int32 new_height 62 default=0
    opt int32 new_width 63 default=0
    opt bool shuffle_images 64 default=false
    opt uint32 concat_dim 65 default=1
    opt HDF5OutputParameter hdf5_output_param 1001
""", re.M))
_MESSAGES["LogParameter"] = _MESSAGES["ExpParameter"]  # the same fields: base, scale, shift

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {name: getattr(_FDP, f"TYPE_{name.upper()}")
            for name in ("double", "float", "int64", "uint64", "int32", "uint32", "bool", "string", "bytes")}
_LABELS = {"opt": _FDP.LABEL_OPTIONAL, "rep": _FDP.LABEL_REPEATED, "req": _FDP.LABEL_REQUIRED}


def _resolve(type_name: str, message: str) -> tuple[int, str]:
    """Return (field type, fully qualified type name) for a non-scalar type token."""
    nested = f"{message}.{type_name}"
    if nested in _ENUMS:
        return _FDP.TYPE_ENUM, f".{_PACKAGE}.{nested}"
    if type_name in _ENUMS:
        return _FDP.TYPE_ENUM, f".{_PACKAGE}.{type_name}"
    if type_name in _MESSAGES:
        return _FDP.TYPE_MESSAGE, f".{_PACKAGE}.{type_name}"
    raise RuntimeError(f"caffe schema: unknown type {type_name!r} in message {message}")


def _add_enum(container: Any, name: str, values: str) -> None:
    enum = container.enum_type.add(name=name)
    for item in values.split():
        key, number = item.split(":")[0].split("=")
        enum.value.add(name=key, number=int(number))


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="sparknet/caffe/caffe.proto", package=_PACKAGE, syntax="proto2"
    )
    messages = {}
    for name, spec in _MESSAGES.items():
        msg = fdp.message_type.add(name=name)
        messages[name] = msg
        for line in spec.strip().splitlines():
            tokens = line.split()
            label, type_token, field_name, number = tokens[:4]
            field = msg.field.add(name=field_name, number=int(number), label=_LABELS[label])
            if type_token in _SCALARS:
                field.type = _SCALARS[type_token]
            else:
                field.type, field.type_name = _resolve(type_token, name)
            for option in tokens[4:]:
                if option == "packed":
                    field.options.packed = True
                elif option.startswith("default="):
                    field.default_value = option[len("default="):]
                else:  # pragma: no cover - schema typo
                    raise RuntimeError(f"caffe schema: bad option {option!r} in {name}")
    for qualified, values in _ENUMS.items():
        if "." in qualified:
            owner, enum_name = qualified.split(".")
            _add_enum(messages[owner], enum_name, values)
        else:
            _add_enum(fdp, qualified, values)
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(_build_file().SerializeToString())


def message_class(name: str) -> type:
    """Return the generated message class for a Caffe message, e.g. ``"LayerParameter"``.

    Parameters
    ----------
    name : str
        The message name without the ``caffe.`` package prefix.
    """
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


NetParameter = message_class("NetParameter")
LayerParameter = message_class("LayerParameter")
V1LayerParameter = message_class("V1LayerParameter")
SolverParameter = message_class("SolverParameter")
BlobProto = message_class("BlobProto")
FillerParameter = message_class("FillerParameter")
