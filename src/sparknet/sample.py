"""Sampling text from a character-level language model (``sparknet sample``).

>>> corpus = shakespeare()                                             # doctest: +SKIP
>>> print(sample_text(net, corpus, prime="ROMEO:", length=300))        # doctest: +SKIP

The model is any net mapping ``[B, T]`` character ids to ``[B, T, V]`` logits, as
:func:`sparknet.zoo.char_lstm` does. Its recurrent layers start every sequence from a zero
state (the DSL's LSTM carries no state between calls), so each new character is drawn
from the logits of the last position of a window of the most recent ``context``
characters, the same situation the model was trained in with truncated backpropagation
through sequences of that length.

The command line::

    sparknet sample --model-dir runs/char_lstm/model --prime "ROMEO:" --length 300
    sparknet sample --checkpoint weights.safetensors --corpus shakespeare --hidden 256 --num-layers 2

A model folder (:func:`sparknet.model_io.save_model`) that stores the vocabulary in its
manifest metadata (``{"vocab": "<the characters, in id order>"}``, as
``examples/char_lstm.py`` writes) needs nothing else; otherwise ``--corpus`` rebuilds the
vocabulary from the corpus the model was trained on.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from sparknet.datasets import Vocabulary, shakespeare

__all__ = ["Vocabulary", "sample_text", "load_char_model", "configure_sample", "run_sample"]

log = logging.getLogger(__name__)


def sample_text(net_or_module: Any, corpus: Any, prime: str = "ROMEO:", length: int = 300,
                temperature: float = 0.8, seed: int = 0, context: int | None = None) -> str:
    """Generate ``length`` characters after ``prime``, one at a time.

    Parameters
    ----------
    net_or_module : Net, SavedModel or torch.nn.Module
        A model taking ``[B, T]`` ids and returning ``[B, T, V]`` logits.
    corpus : CharCorpus, Vocabulary or sequence of str
        What maps characters to ids (the vocabulary the model was trained with).
    prime : str
        Text to start from (every character must be in the vocabulary); it is not part of
        the returned string. An empty prime starts from a newline when the vocabulary has
        one, else from its first character.
    length : int
        Characters to generate.
    temperature : float
        Divides the logits: below 1 is more conservative, above 1 more varied; 0 always
        takes the most likely character.
    seed : int
        Seeds the sampling (the global torch generator is not touched).
    context : int, optional
        Most recent characters the model sees at each step; default: the sequence length
        of the net's input layer, else 100.

    Returns
    -------
    str
        The ``length`` generated characters.
    """
    import torch

    if length < 0:
        raise ValueError(f"length must be non-negative, got {length}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a non-negative number, got {temperature}")
    codec = corpus if all(hasattr(corpus, a) for a in ("encode", "decode", "vocab")) else Vocabulary(corpus)
    module = net_or_module if isinstance(net_or_module, torch.nn.Module) else getattr(net_or_module, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError("sample_text takes a Net, a SavedModel or a torch.nn.Module, got "
                        f"{type(net_or_module).__name__}")
    declared = (int(layer.shape[1]) for layer in getattr(getattr(module, "net_params", None), "layers", ()) or ()
                if len(getattr(layer, "shape", None) or ()) >= 2)  # the input layer's sequence length
    window = int(context or next(declared, None) or 100)
    if window < 1:
        raise ValueError(f"context must be at least 1, got {window}")
    if not prime:
        prime = "\n" if "\n" in codec.vocab else codec.vocab[0]
    ids = [int(i) for i in codec.encode(prime)]
    gen = torch.Generator().manual_seed(int(seed))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for _ in range(length):
                x = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
                logits = module(x)[0, -1].float().cpu()
                if logits.numel() != len(codec.vocab):
                    raise ValueError(f"the model predicts {logits.numel()} classes but the vocabulary has "
                                     f"{len(codec.vocab)} characters; give the corpus the model was trained on")
                if temperature == 0:
                    nxt = int(logits.argmax())
                else:
                    nxt = int(torch.multinomial(torch.softmax(logits / temperature, dim=0), 1, generator=gen))
                ids.append(nxt)
    finally:
        module.train(was_training)
    return codec.decode(ids[len(ids) - length:])


# --------------------------------------------------------------------------- command line


def configure_sample(parser: argparse.ArgumentParser) -> None:
    """Add ``sparknet sample``'s arguments to ``parser`` and set its runner (``_run``)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", help="a sparknet model folder (sparknet_model.json and its files)")
    source.add_argument("--checkpoint", help="a safetensors weights file of zoo.char_lstm (with --corpus and the "
                                             "model's --hidden, --num-layers, --seq-len)")
    parser.add_argument("--corpus", default=None,
                        help="the corpus the model was trained on, for its vocabulary: 'shakespeare' or a text file "
                             "(default: the vocabulary stored in the model folder)")
    parser.add_argument("--prime", default="ROMEO:", help="text to start from")
    parser.add_argument("--length", type=int, default=300, help="characters to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: most likely)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--context", type=int, default=None, help="characters the model sees per step "
                                                                  "(default: its declared sequence length)")
    net = parser.add_argument_group("the net, with --checkpoint")
    net.add_argument("--hidden", type=int, default=256, help="LSTM hidden size")
    net.add_argument("--num-layers", type=int, default=2, help="stacked LSTM layers")
    net.add_argument("--seq-len", type=int, default=100, help="sequence length it was trained on")
    net.add_argument("--embed-dim", type=int, default=None, help="embedding width (default: --hidden)")
    parser.add_argument("--json", action="store_true", help="print {\"prime\", \"text\"} as JSON")
    parser.set_defaults(_run=run_sample)


def _corpus_vocab(spec: str) -> list[str]:
    if spec == "shakespeare":
        return list(shakespeare().vocab)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--corpus {spec!r} is neither 'shakespeare' nor a text file")
    return sorted(set(path.read_text(encoding="utf-8")))


def load_char_model(args: argparse.Namespace) -> tuple[Any, Vocabulary]:
    """The model and vocabulary ``sparknet sample`` was pointed at."""
    if args.model_dir:
        from sparknet.model_io import load_model

        saved = load_model(args.model_dir)
        vocab = _corpus_vocab(args.corpus) if args.corpus else (saved.manifest.get("metadata") or {}).get("vocab")
        if not args.corpus and not vocab:
            raise ValueError(f"{args.model_dir} stores no vocabulary; pass --corpus (e.g. --corpus shakespeare)")
        return saved.net, Vocabulary(vocab)
    from sparknet import zoo
    from sparknet.net import Net
    from sparknet.weights import WeightCollection

    if not args.corpus:
        raise ValueError("--checkpoint needs --corpus: the weights file carries no vocabulary")
    vocab = _corpus_vocab(args.corpus)
    net = Net(zoo.char_lstm(len(vocab), seq_len=args.seq_len, hidden=args.hidden, num_layers=args.num_layers,
                            batch_size=1, embed_dim=args.embed_dim))
    weights = WeightCollection.load(args.checkpoint)
    try:
        net.set_weights(weights)
    except ValueError as e:
        raise ValueError(f"{args.checkpoint} does not fit char_lstm(vocab={len(vocab)}, hidden={args.hidden}, "
                         f"num_layers={args.num_layers}): {e}") from e
    return net, Vocabulary(vocab)


def run_sample(args: argparse.Namespace) -> int:
    """``sparknet sample``: print the generated text (after the prime)."""
    net, vocab = load_char_model(args)
    text = sample_text(net, vocab, prime=args.prime, length=args.length, temperature=args.temperature,
                       seed=args.seed, context=args.context)
    if getattr(args, "json", False):
        print(json.dumps({"prime": args.prime, "text": text}))
    else:
        print(args.prime + text)
    return 0
