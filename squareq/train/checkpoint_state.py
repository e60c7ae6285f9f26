"""A training run's state besides the LoRA, as tensors plus JSON and back, without pickle: the optimizer's state
(parameters named, not numbered), the learning-rate scheduler's, and the torch, CUDA, Python and numpy RNG states;
restoring each checks that it fits the run. train/checkpoint.py writes the result into a checkpoint folder.

In the JSON, ``{"__tensor__": KEY}`` stands for the tensor KEY of the matching tensor file and ``{"__tuple__": [...]}``
for a tuple (AdamW's ``betas`` must come back as a tuple). State that is not tensors, numbers, strings, lists, tuples
and dicts cannot be encoded; the one case that occurs in practice, ``LambdaLR``'s ``lr_lambdas`` (functions), is
handled by keeping only the scheduler fields that encode and restoring them onto the freshly built scheduler, whose
functions come from the code.
"""
from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

_TENSOR_TAG = "__tensor__"
_TUPLE_TAG = "__tuple__"


class CheckpointError(ValueError):
    """A checkpoint cannot be read or used; the message is one sentence naming the folder and what to do."""


class DamagedState(Exception):
    """Raised by the decoders; train/checkpoint.py's ``load_checkpoint`` turns it into a sentence naming the
    checkpoint to use."""


class NotEncodable(TypeError):
    """A value that cannot be stored without pickle; the message names its key."""


def encode_value(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``obj``; tensors go to ``tensors`` under ``key`` (extended per nesting level)."""
    if isinstance(obj, torch.Tensor):
        if key in tensors:  # only possible with contrived names; refuse rather than overwrite
            raise NotEncodable(f"{key}: two tensors would share this name")
        # clone: safetensors refuses tensors that share storage, and the caller keeps training.
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR_TAG: key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE_TAG: [encode_value(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_value(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise NotEncodable(f"{key}: dictionary keys must be strings")
        return {k: encode_value(v, f"{key}.{k}", tensors) for k, v in obj.items()}
    raise NotEncodable(f"{key}: {type(obj).__name__} cannot be stored without pickle")


def encode_plain(obj: Any, key: str) -> Any:
    """Like :func:`encode_value` for values that must be pure JSON (no tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = encode_value(obj, key, tensors)
    if tensors:
        raise NotEncodable(f"{next(iter(tensors))}: tensors are not allowed here (put them in extra)")
    return encoded


def decode_value(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The value :func:`encode_value` encoded, its tensors taken from ``tensors``."""
    if isinstance(obj, list):
        return [decode_value(v, tensors, where) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR_TAG}:
            name = obj[_TENSOR_TAG]
            if name not in tensors:
                raise DamagedState(f"tensor {name!r} is missing")
            return tensors[name]
        if set(obj) == {_TUPLE_TAG}:
            return tuple(decode_value(v, tensors, where) for v in obj[_TUPLE_TAG])
        return {k: decode_value(v, tensors, where) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- optimizer


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``param_groups`` order, the order ``param_names`` names them in."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def check_param_names(optimizer: torch.optim.Optimizer, param_names: list[str]) -> None:
    """``param_names`` names each of the optimizer's parameters once."""
    n = len(optimizer_params(optimizer))
    if len(param_names) != n:
        raise ValueError(f"param_names has {len(param_names)} names but the optimizer holds {n} parameters.")
    if len(set(param_names)) != n:
        raise ValueError("param_names must be unique.")


def encode_optimizer(optimizer, param_names, tensors) -> dict:
    """The optimizer's state as JSON, its tensors added to ``tensors``; parameters by name, not number."""
    sd = optimizer.state_dict()
    # state_dict numbers parameters 0..n-1 in param_groups order, which is param_names' order.
    state = {}
    for index, per_param in sd["state"].items():
        name = param_names[index]
        state[name] = encode_value(per_param, f"state.{name}", tensors)
    groups = []
    for g, group in enumerate(sd["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({
            "params": [param_names[i] for i in group["params"]],
            "hyper": encode_value(hyper, f"param_groups.{g}", tensors),
        })
    params = optimizer_params(optimizer)
    return {
        "class": type(optimizer).__name__,
        "param_shapes": {name: list(p.shape) for name, p in zip(param_names, params)},
        "state": state,
        "param_groups": groups,
    }


def restore_optimizer(optimizer, param_names, saved: dict, tensors, where: str) -> None:
    """Load :func:`encode_optimizer`'s result into ``optimizer``, refusing one made for other parameters."""
    def refuse(detail: str):
        raise CheckpointError(
            f"checkpoint {where} was made for a different LoRA (rank/targets): {detail}; "
            "train into a new output folder or pass --resume with a checkpoint of this configuration."
        )

    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint {where} was made with the {saved['class']} optimizer, not {type(optimizer).__name__}; "
            "use the same optimizer or start a new run."
        )
    params = optimizer_params(optimizer)
    index = {name: i for i, name in enumerate(param_names)}
    shapes = saved["param_shapes"]
    missing = [n for n in param_names if n not in shapes]
    extra = [n for n in shapes if n not in index]
    if missing or extra:
        parts = [f"{len(missing)} parameter(s) are new here, e.g. {missing[0]}" if missing else "",
                 f"{len(extra)} parameter(s) are gone, e.g. {extra[0]}" if extra else ""]
        refuse(" and ".join(p for p in parts if p))
    for name, p in zip(param_names, params):
        if list(p.shape) != shapes[name]:
            refuse(f"{name} has shape {shapes[name]} there and {list(p.shape)} here")

    groups_now = []
    start = 0
    for group in optimizer.param_groups:
        groups_now.append(param_names[start:start + len(group["params"])])
        start += len(group["params"])
    saved_groups = saved["param_groups"]
    if [set(g["params"]) for g in saved_groups] != [set(g) for g in groups_now]:
        refuse("its parameter groups hold different parameters")

    # Rebuild a state_dict numbered the way *this* optimizer numbers its parameters, so that
    # Optimizer.load_state_dict's positional id mapping lands each state on the right parameter.
    sd = {"state": {}, "param_groups": []}
    for name, per_param in saved["state"].items():
        sd["state"][index[name]] = decode_value(per_param, tensors, where)
    for g, names in zip(saved_groups, groups_now):
        group = dict(decode_value(g["hyper"], tensors, where))
        group["params"] = [index[n] for n in names]
        sd["param_groups"].append(group)
    optimizer.load_state_dict(sd)


# --------------------------------------------------------------------------- scheduler and RNG


def encode_scheduler(scheduler, tensors) -> dict | None:
    """The scheduler's state fields that encode (None without a scheduler); the others are listed as dropped."""
    if scheduler is None:
        return None
    kept, dropped = {}, []
    for key, value in scheduler.state_dict().items():
        part: dict[str, torch.Tensor] = {}
        try:
            kept[key] = encode_value(value, f"scheduler.{key}", part)
        except NotEncodable:
            # e.g. LambdaLR's lr_lambdas holding a callable object's __dict__: comes from code on resume.
            dropped.append(key)
            continue
        tensors.update(part)
    return {"class": type(scheduler).__name__, "state": kept, "dropped": dropped}


def restore_scheduler(scheduler, saved: dict | None, tensors, where: str) -> None:
    """Load :func:`encode_scheduler`'s fields onto the freshly built ``scheduler``."""
    if scheduler is None:
        return
    if saved is None:
        warnings.warn(f"checkpoint {where} has no learning-rate scheduler state; the scheduler starts afresh.",
                      stacklevel=2)
        return
    if saved["class"] != type(scheduler).__name__:
        raise CheckpointError(
            f"checkpoint {where} was made with the {saved['class']} scheduler, not {type(scheduler).__name__}; "
            "use the same scheduler or start a new run."
        )
    # Start from the fresh scheduler's own state so fields that could not be saved keep their code values.
    state = scheduler.state_dict()
    state.update(decode_value(saved["state"], tensors, where))
    scheduler.load_state_dict(state)


def capture_rng(tensors) -> dict:
    """The torch, CUDA, Python and numpy RNG states (the torch and CUDA ones into ``tensors``)."""
    tensors["rng.torch"] = torch.get_rng_state()
    cuda = []
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s.cpu()
            cuda.append(f"rng.cuda.{i}")
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": "rng.torch",
        "cuda": cuda,
        "python": [version, list(internal), gauss_next],
        # numpy's MT19937 key is 624 uint32 words: a JSON list of ints is exact.
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
    }


def restore_rng(saved: dict, tensors, where: str) -> None:
    """Set every RNG to :func:`capture_rng`'s states; CUDA's only on a machine with as many devices."""
    try:
        torch.set_rng_state(tensors[saved["torch"]])
        version, internal, gauss_next = saved["python"]
        random.setstate((version, tuple(internal), gauss_next))
        n = saved["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise DamagedState(f"its random-number state is unreadable: {exc}") from exc
    cuda = [tensors[k] for k in saved["cuda"] if k in tensors]
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(f"checkpoint {where} holds {len(cuda)} CUDA RNG states that do not match this machine's "
                          "devices; CUDA random numbers will differ from an uninterrupted run.", stacklevel=2)
