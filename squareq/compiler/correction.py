"""Output correction: after the plan, each quantized layer's per-channel scale and bias are refitted on the quantized
model's own inputs, so that its outputs keep the source model's per-channel mean and spread (docs/compiler.md,
"Output correction").

Rounding shrinks a layer's output spread a little, and each layer's error shifts the mean of what the next layers
read; both compound block after block. For each output channel ``c`` of a layer, with ``y`` its output in the source
model and ``ŷ`` the quantized layer's output in the quantized model (every layer it reads from already corrected):

    a_c = std_c(y) / std_c(ŷ),    b'_c = mean_c(y) − a_c · (mean_c(ŷ) − b_c)

``a`` is folded into the stored group scales (``quant.scale_rows``) and ``b'`` replaces the bias; a layer without a
bias gets the ratio of root mean squares. Nothing is added to the slab or to the step. Statistics come from the
calibration samples the search fitted on; the held-out samples judge.

The fit needs both models in lockstep, and within a block a layer may be fitted only after every layer it reads from:
fitted from one pass of the block, a downstream layer would correct its upstream layer's error a second time (on
all-MiniLM-L6-v2 that made the output error 3x plain rounding's instead of 0.35x). So the model's own forward runs
over two copies of the calibration batch, the first through the source blocks and the second through the quantized
ones, and inside each block the layers are grouped by dependency depth (read from the autograd graph of one sample):
q, k and v together, then the attention's output, and so on, one pass of the block per group.

A layer's correction is kept only if its output error on the held-out samples' source inputs, bias included, stays at
or below plain rounding's at its format (the rule every candidate of the search meets); the driver keeps the whole
correction only if it lowers the model's output error on the held-out samples.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import quant
from ..quant import QuantizedWeight
from ..slab.writer import block_linears, stored_tensor
from .chunks import BatchAxes, CallAxes, call_batch, join_outputs, run_chunked
from .effect import batch_size, repeat_batch
from .progress import CompileProgress

MODES = ("auto", "on", "off")


@dataclass
class LayerFix:
    """One layer's correction: ``scale [N]`` for its output rows, ``bias [N]`` as the slab stores it (None: the
    layer has none), and its held-out errors."""

    scale: torch.Tensor
    bias: torch.Tensor | None
    metrics: dict[str, float]


@dataclass
class Correction:
    """The layers' corrections and a record of the fit (for the manifest's calibration block)."""

    fixes: dict[str, LayerFix] = field(default_factory=dict)
    record: dict = field(default_factory=dict)

    def weights(self, weights: Mapping[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        """``weights`` with each corrected layer's scale folded in."""
        return {n: quant.scale_rows(qw, self.fixes[n].scale) if n in self.fixes else qw for n, qw in weights.items()}

    def biases(self, names) -> dict[str, torch.Tensor]:
        """The corrected biases among ``names``."""
        return {n: self.fixes[n].bias for n in names if n in self.fixes and self.fixes[n].bias is not None}


def wanted(mode: str, description: dict, heldout: tuple[int, ...]) -> str | None:
    """None when ``--output-correction mode`` fits a correction for this calibration batch, else why not. ``auto``
    corrects models calibrated on text, where it was measured (docs/compiler.md); image models only with ``on``."""
    if mode not in MODES:
        raise ValueError(f"--output-correction {mode!r} is not one of {', '.join(MODES)}.")
    if mode == "off":
        return "--output-correction off"
    if not heldout:
        return "no calibration samples are held out to judge it"
    if mode == "auto" and description.get("kind") != "text":
        return "--output-correction auto corrects text models only (not measured on image models yet)"
    return None


class NotFitted(Exception):
    """The correction cannot be fitted for this model; the message says why."""


UNSPLIT = "the model's blocks cannot be run a few samples at a time"

# The keys a corrected layer's manifest metrics get or have replaced (the size plan reserves their widest form).
METRICS = ("output_rel_mse", "heldout_rel_mse", "heldout_rtn_rel_mse", "heldout_uncorrected_rel_mse",
           "weight_rel_mse", "weight_sqnr_db", "corrected", "correction_scale_min", "correction_scale_max")


def fit_correction(source, kwargs: dict, row_mask: torch.Tensor | None, heldout: tuple[int, ...],
                   weights_of: Callable[[int], Mapping[str, QuantizedWeight]], batched: set[str], axes: BatchAxes,
                   device="cpu", progress: CompileProgress | None = None,
                   biases_of: Callable[[int], Mapping[str, torch.Tensor]] = lambda i: {}) -> Correction:
    """Fit every quantized layer's correction (module docstring) on the calibration batch ``kwargs`` (its samples
    ``heldout`` judge), starting from the plan's weights ``weights_of(block)`` and the biases ``biases_of(block)``
    replaces (a rebuild's layers that keep a previous slab's corrected weights keep its biases with them); raises
    :class:`NotFitted` with the reason when it cannot be fitted."""
    started = time.perf_counter()
    samples = batch_size(kwargs, batched)
    held = sorted(set(heldout))
    fit = [i for i in range(samples) if i not in set(held)]
    progress = CompileProgress() if progress is None else progress
    lockstep = _Lockstep(source, weights_of, biases_of, samples, fit, held, row_mask, axes, device, progress)
    doubled = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, repeat_batch(kwargs, batched, 2))
    shell = source.shell(lockstep, device, upcast_linears=True)
    with torch.no_grad(), progress.blocks(len(source.block_paths), "output correction"):
        shell(**doubled)
    fixes = lockstep.fixes
    scales = torch.cat([f.scale for f in fixes.values()]) if fixes else torch.ones(1)
    record = {"layers": lockstep.considered, "corrected": len(fixes),
              "refused": lockstep.refused, "passes": lockstep.passes,
              "scale_min": float(scales.min()), "scale_max": float(scales.max()),
              "fit_samples": len(fit), "seconds": round(time.perf_counter() - started, 3)}
    return Correction(fixes, record)


class _Lockstep:
    """The block stand-in of the lockstep forward: the first half of each call's batch through the source block,
    the second through the quantized block, which is corrected group by group on the way."""

    def __init__(self, source, weights_of, biases_of, samples: int, fit: list[int], held: list[int],
                 row_mask: torch.Tensor | None, axes: BatchAxes, device, progress) -> None:
        self.source, self.weights_of, self.biases_of, self.samples = source, weights_of, biases_of, samples
        self.fit, self.held, self.device, self.progress = fit, held, device, progress
        self.row_mask = row_mask.to(device) if row_mask is not None else None
        self.axes, self.cursor = axes, axes.cursor()
        self.fixes: dict[str, LayerFix] = {}
        self.considered = self.refused = self.passes = 0

    def __call__(self, index: int, path: str, args, kw):
        leaves, spec = tree_flatten((args, kw))
        n = self.samples
        call = self.cursor.next(index)
        if call is None:
            tokens = self.row_mask.shape[1] if self.row_mask is not None else None
            if tokens in (n, 2 * n):  # a token axis would be taken for the batch
                raise NotFitted(UNSPLIT)
            call = _guessed(leaves, 2 * n)
        if call_batch(leaves, call) != 2 * n:
            raise NotFitted(UNSPLIT)
        everyone = list(range(n))
        where = f"output correction, block {index + 1}/{len(self.source.block_paths)} {path}"
        self.progress.begin(where)
        source_block = self.source.load_block(path, self.device, torch.float32, upcast_linears=True)
        weights = {name: qw.to(self.device) for name, qw in self.weights_of(index).items()}
        quantized = self.source.load_block(path, self.device, torch.float32, upcast_linears=True)
        layers = {name: mod for name, mod in block_linears(path, quantized) if name in weights}
        biases = self.biases_of(index)
        for name, mod in layers.items():
            mod.weight.copy_(quant.dequantize(weights[name]).to(mod.weight.dtype))
            if name in biases:
                mod.bias.copy_(biases[name].to(mod.bias))
        todo = [name for name in layers if not weights[name].spec.is_passthrough]
        targets = _Watch(path, source_block, todo, self._mask(everyone, weighted=self.fit))
        with targets:
            out_source = self._run(source_block, leaves, spec, call, everyone, targets)
        self.passes += 1
        fit_q = [n + i for i in self.fit]
        for group in _groups(path, quantized, todo, self._take(leaves, spec, call, [fit_q[0]])):
            self.progress.now(f"{where}: {', '.join(x[len(path) + 1:] for x in group)}")
            seen = _Watch(path, quantized, group, self._mask(self.fit))
            with seen:
                self._run(quantized, leaves, spec, call, fit_q, seen)
            proposed = {x: _fit(targets.moments[x], seen.moments[x], layers[x].bias) for x in group
                        if x in targets.moments and x in seen.moments}
            judged = _Judge(path, source_block, {x: (weights[x], proposed[x]) for x in proposed},
                            self._mask(self.held))
            with judged:
                self._run(source_block, leaves, spec, call, self.held, judged)
            self.passes += 2
            for x, fix in judged.verdicts().items():
                self.considered += 1
                if fix is None:
                    self.refused += 1
                    continue
                self.fixes[x] = fix
                corrected = quant.scale_rows(weights[x], fix.scale)
                layers[x].weight.copy_(quant.dequantize(corrected).to(layers[x].weight.dtype))
                if fix.bias is not None:
                    layers[x].bias.copy_(fix.bias)
        out_quantized = self._run(quantized, leaves, spec, call, [n + i for i in everyone])
        self.passes += 1
        flags = call.outputs or tuple(x.dim() > 0 and x.shape[0] == n for x in tree_flatten(out_source)[0]
                                      if torch.is_tensor(x))
        self.progress.done()
        return join_outputs([out_source, out_quantized], flags)

    def _mask(self, samples: list[int], weighted: list[int] | None = None) -> torch.Tensor:
        """``[len(samples), tokens]`` (or ``[len(samples)]`` for models without a row mask): 1 where a row counts,
        for passes over ``samples``; ``weighted`` keeps only those samples' rows."""
        pick = torch.tensor(samples, device=self.device)
        if self.row_mask is not None:
            mask = self.row_mask[pick].float()
        else:
            mask = torch.ones(len(samples), device=self.device)
        if weighted is not None:
            keep = torch.zeros(self.samples, device=self.device)
            keep[torch.tensor(weighted, device=self.device)] = 1.0
            mask = mask * keep[pick].reshape(-1, *([1] * (mask.dim() - 1)))
        return mask

    def _take(self, leaves, spec, call: CallAxes, samples: list[int]):
        """The call's arguments for ``samples`` only (indices into its batch)."""
        pick = torch.tensor(samples, device=self.device)
        flags = iter(call.inputs)
        return tree_unflatten([x.index_select(0, pick.to(x.device)) if torch.is_tensor(x) and next(flags) else x
                               for x in leaves], spec)

    def _run(self, block: nn.Module, leaves, spec, call: CallAxes, samples: list[int], watch=None):
        args, kw = self._take(leaves, spec, call, samples)
        whole = not call.outputs  # a guessed call runs unchunked: its outputs' batch axes are not known
        ranges = [(0, len(samples))] if whole else self.axes.ranges(len(samples))
        return run_chunked(block, args, kw, call, ranges, each=watch.window if watch is not None else None)


def _guessed(leaves, batch: int) -> CallAxes:
    """A call's batch axes when the probe found none (a forward that does not run on the meta device, as BERT's
    mask handling): the tensors whose first axis is the doubled batch's size, which no other argument of a text model
    shares (its token count is at most a few hundred, the doubled batch a thousand); run whole, not in chunks."""
    return CallAxes(tuple(x.dim() > 0 and x.shape[0] == batch for x in leaves if torch.is_tensor(x)), (), 0)


class _Watch:
    """Per output channel of each named layer: the count, sum and sum of squares (float64) of its output over the
    rows that count (``mask``, by the chunk's window)."""

    def __init__(self, path: str, block: nn.Module, names, mask: torch.Tensor) -> None:
        self.modules = {name: mod for name, mod in block_linears(path, block) if name in set(names)}
        self.mask, self.span = mask, (0, 0)
        self.moments: dict[str, torch.Tensor] = {}
        self.handles = []

    def __enter__(self):
        self.handles = [mod.register_forward_hook(self._hook(name)) for name, mod in self.modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def window(self, start: int, stop: int):
        self.span = (start, stop)
        return contextlib.nullcontext()

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a layer's input or output ``t`` that count, for the current chunk."""
        m = self.mask[self.span[0]:self.span[1]]
        if t.dim() > m.dim() and tuple(t.shape[:m.dim()]) == tuple(m.shape):
            w = m.reshape(*m.shape, *([1] * (t.dim() - 1 - m.dim()))).expand(t.shape[:-1])
        elif bool((m == m.reshape(-1)[0]).all()):  # the batch axis is not first, but every row counts alike
            w = torch.full(t.shape[:-1], float(m.reshape(-1)[0]), device=t.device)
        else:
            raise NotFitted(UNSPLIT)
        return t.reshape(-1, t.shape[-1])[w.reshape(-1) > 0]

    def _hook(self, name: str):
        def hook(module, args, out):
            y = self.rows(out.detach())
            if not y.shape[0]:
                return
            y = y.double()
            part = torch.stack([torch.full_like(y[0], y.shape[0]), y.sum(0), y.square().sum(0)])
            self.moments[name] = self.moments[name] + part if name in self.moments else part
        return hook


def _fit(target: torch.Tensor, seen: torch.Tensor, bias: torch.Tensor | None):
    """``(a, b')`` from the source layer's output moments ``target`` and the quantized layer's ``seen`` (rows:
    count, sum, sum of squares)."""
    mean_t, mean_q = target[1] / target[0], seen[1] / seen[0]
    if bias is None:
        rms_t, rms_q = (target[2] / target[0]).sqrt(), (seen[2] / seen[0]).sqrt()
        a = torch.where(rms_q > 0, rms_t / rms_q.clamp_min(1e-300), torch.ones_like(rms_q))
        return _bounded(a), None
    var_t = (target[2] / target[0] - mean_t.square()).clamp_min(0)
    var_q = (seen[2] / seen[0] - mean_q.square()).clamp_min(0)
    a = _bounded(torch.where(var_q > 0, (var_t / var_q.clamp_min(1e-300)).sqrt(), torch.ones_like(var_q)))
    b = mean_t - a * (mean_q - bias.double())
    return a, stored_tensor(b.float()).float()


def _bounded(a: torch.Tensor) -> torch.Tensor:
    """Scales outside [0.5, 2] are not a quantization error's doing (a channel the fit rows barely use): left at 1."""
    a = torch.where(torch.isfinite(a) & (a >= 0.5) & (a <= 2.0), a, torch.ones_like(a))
    return a.double()


JUDGE_ROWS = 4096


class _Judge(_Watch):
    """On the held-out samples' source inputs: each proposed layer's output error with the correction (bias
    included), and plain rounding's at its format; the correction passes when it is not above plain rounding's."""

    def __init__(self, path: str, block: nn.Module, proposed: Mapping[str, tuple[QuantizedWeight, tuple]],
                 mask: torch.Tensor) -> None:
        super().__init__(path, block, proposed, mask)
        self.proposed = proposed
        self.sums: dict[str, list[float]] = {}  # name: [power, plan, corrected, plain rounding]
        self.deltas = {}  # name: the source weight, and the plan's, the corrected and plain rounding's differences
        for name, (qw, (a, _)) in proposed.items():
            w = self.modules[name].weight.detach().float()
            plain = replace(qw.spec, clip_ratio=1.0, smooth=False, rotate=False)
            self.deltas[name] = (w, quant.dequantize(qw).float() - w,
                                 quant.dequantize(quant.scale_rows(qw, a.float())).float() - w,
                                 quant.dequantize(quant.quantize(w, plain)).float() - w)

    def _hook(self, name: str):
        def hook(module, args, out):
            x = self.rows(args[0].detach())
            w, plan, corrected, plain = self.deltas[name]
            b = self.proposed[name][1][1]
            shift = b - module.bias.detach().float() if b is not None else 0.0
            sums = self.sums.get(name, [0.0] * 4)
            for start in range(0, x.shape[0], JUDGE_ROWS):  # [rows, N] float32 products a slice of rows at a time
                part = x[start:start + JUDGE_ROWS].float()
                errors = (part @ w.T, part @ plan.T, part @ corrected.T + shift, part @ plain.T)
                sums = [p + float(e.double().square().sum()) for p, e in zip(sums, errors)]
            self.sums[name] = sums
        return hook

    def verdicts(self) -> dict[str, LayerFix | None]:
        out = {}
        for name, (_, (a, b)) in self.proposed.items():
            power, plan, corrected, plain = self.sums.get(name, [0.0, 0.0, math.inf, 0.0])
            power = max(power, 1e-30)
            if corrected > plain:
                out[name] = None
                continue
            w, _, delta, _ = self.deltas[name]
            deq = w + delta
            out[name] = LayerFix(a.float(), b, {
                "output_rel_mse": corrected / power, "heldout_rel_mse": corrected / power,
                "heldout_rtn_rel_mse": plain / power, "heldout_uncorrected_rel_mse": plan / power,
                "weight_rel_mse": float(quant.rel_mse(w, deq)), "weight_sqnr_db": quant.sqnr_db(w, deq),
                "corrected": 1.0, "correction_scale_min": float(a.min()), "correction_scale_max": float(a.max())})
        return out


def _groups(path: str, block: nn.Module, names: list[str], sample) -> list[list[str]]:
    """``names`` grouped by dependency depth in ``block``: a layer's depth is one more than the deepest layer whose
    output its input was computed from (found by walking one sample's autograd graph), so each group reads only
    from earlier groups. Where the graph cannot tell (an input computed without a gradient), a layer is taken to read
    from every layer called before it; a layer the sample does not reach is fitted alone, after the others.
    Raises :class:`NotFitted` when the block does not run with gradients."""
    args, kw = sample
    leaves, spec = tree_flatten((args, kw))
    # clones of leaves that need a gradient: a block that writes into its input in place may
    leaves = [x.detach().requires_grad_(True).clone() if torch.is_tensor(x) and x.is_floating_point() else x
              for x in leaves]
    modules = dict(block_linears(path, block))
    made: dict = {}
    depth: dict[str, int] = {}
    called: list[str] = []

    def before(name):
        def hook(module, a):
            x = a[0] if a and torch.is_tensor(a[0]) else None
            if x is None or x.grad_fn is None:  # unknown: after everything so far
                d = 1 + max((depth[c] for c in called), default=-1)
            else:
                d = _depth_above(x.grad_fn, made, depth)
            depth[name] = max(depth.get(name, 0), d)
            called.append(name)
        return hook

    def after(name):
        def hook(module, a, out):
            if torch.is_tensor(out) and out.grad_fn is not None:
                made[out.grad_fn] = name
        return hook

    handles = [m.register_forward_pre_hook(before(n)) for n, m in modules.items()]
    handles += [m.register_forward_hook(after(n)) for n, m in modules.items()]
    try:
        with torch.enable_grad():
            a, k = tree_unflatten(leaves, spec)
            block(*a, **k)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe: no correction, with the reason
        raise NotFitted(f"its blocks do not run with gradients for the dependency probe ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:100]})") from None
    finally:
        for h in handles:
            h.remove()
    levels: dict[int, list[str]] = {}
    for name in names:
        if name in depth:
            levels.setdefault(depth[name], []).append(name)
    groups = [levels[d] for d in sorted(levels)]
    return groups + [[name] for name in names if name not in depth]


def _depth_above(node, made: dict, depth: dict[str, int]) -> int:
    """One more than the deepest layer output that ``node``'s graph reaches (0: none)."""
    best, stack, seen = 0, [node], set()
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if n in made:
            best = max(best, depth.get(made[n], 0) + 1)
            continue
        stack.extend(nxt for nxt, _ in n.next_functions)
    return best
