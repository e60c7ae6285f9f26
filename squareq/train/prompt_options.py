"""Per-prompt sampling options in kohya's prompt-file syntax, for ``squareq sample`` and training samples.

A prompt may end with options, each ``--<letter> <value>``::

    a red fox in the snow --w 768 --h 1024 --s 28 --g 3.5 --d 42 --n blurry, low quality --l 4

``--w``/``--h`` width and height (multiples of 16), ``--s`` denoising steps, ``--g`` FLUX's embedded guidance,
``--d`` the seed, ``--n`` a negative prompt and ``--l`` the true classifier-free guidance scale that uses it (FLUX.1
is guidance-distilled: a negative prompt acts only with ``--l`` above 1, as in kohya's sampler, and each step then
runs the transformer twice), ``--f`` the frames of a video family's clip (musubi-tuner's option), ``--ci`` a control
image to edit (musubi-tuner's option, repeated for several, in order; FLUX.1 Kontext, Qwen-Image-Edit and FLUX.2's
reference images, each sized as its family's pipeline sizes it). What a prompt
does not set comes from the command's flags. A prompt file holds one
prompt a line; empty lines and lines starting with ``#`` are skipped, as kohya's are.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .data import refused_character

log = logging.getLogger("squareq.sample")

MAX_GUIDANCE = 100.0  # beyond this a FLUX guidance or CFG scale is a typo


class PromptError(ValueError):
    """A prompt's options cannot work; the message names the prompt and the option."""


@dataclass(frozen=True)
class SamplePrompt:
    """One prompt and its drawing settings (None: the command's)."""

    text: str
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    negative: str | None = None
    cfg_scale: float | None = None
    frames: int | None = None
    controls: tuple[str, ...] = ()  # control images to edit (``--ci``, repeatable), in order

    def settled(self, resolution: int, steps: int, guidance: float, seed: int, frames: int = 1,
                controls: tuple[str, ...] = ()) -> SamplePrompt:
        """Every setting filled in, the command's where the prompt has none (``controls``: its ``--control``
        images)."""
        return replace(self, width=self.width or resolution, height=self.height or resolution,
                       steps=self.steps or steps, guidance=guidance if self.guidance is None else self.guidance,
                       seed=seed if self.seed is None else self.seed,
                       cfg_scale=1.0 if self.cfg_scale is None else self.cfg_scale, frames=self.frames or frames,
                       controls=self.controls or tuple(controls))

    @property
    def texts(self) -> list[str]:
        """The texts to encode: the prompt, and the negative one where it acts."""
        return [self.text] + ([self.negative] if self.uses_negative else [])

    @property
    def uses_negative(self) -> bool:
        return bool(self.negative) and (self.cfg_scale or 1.0) > 1.0


MAX_SIDE = 8192  # pixels: FLUX.1 is trained up to about 2 MP; beyond this a side is a typo
MAX_STEPS = 1000  # kohya's bound
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes
MAX_FRAMES = 1025  # a clip's frames: Wan draws 81, HunyuanVideo 129, LTX-Video up to 257


def _size(v: str) -> int:
    n = int(v)
    if n < 16 or n % 16 or n > MAX_SIDE:
        raise ValueError(f"must be a multiple of 16 from 16 to {MAX_SIDE} (FLUX packs 2x2 patches of an 8x VAE)")
    return n


def _count(least: int, most: int):
    def parse(v: str) -> int:
        n = int(v)
        if not least <= n <= most:
            raise ValueError(f"must be a whole number from {least} to {most}")
        return n
    return parse


def _scale(least: float):
    def parse(v: str) -> float:
        x = float(v)
        if not math.isfinite(x) or not least <= x <= MAX_GUIDANCE:
            raise ValueError(f"must be a number from {least:g} to {MAX_GUIDANCE:g}")
        return x
    return parse


def _image(v: str) -> str:
    path = Path(v).expanduser()
    if not v or not path.is_file():
        raise ValueError("must name an existing image file (a control image to edit)")
    return str(path)


OPTIONS = {"w": ("width", _size), "h": ("height", _size), "s": ("steps", _count(1, MAX_STEPS)),
           "g": ("guidance", _scale(0.0)), "d": ("seed", _count(0, MAX_SEED)), "n": ("negative", str),
           "l": ("cfg_scale", _scale(1.0)), "f": ("frames", _count(1, MAX_FRAMES)), "ci": ("controls", _image)}
REPEATABLE = ("ci",)  # options a prompt may give several times, each adding one (several control images)
# kohya options that choose what SquareQ's FLUX sampler does not offer: skipped with a warning, so a kohya prompt
# file works as it is
IGNORED = {"ss": "a sampler (SquareQ draws with the pipeline's own scheduler)", "fs": "a flow shift",
           "cn": "a ControlNet image", "am": "attention-mask options"}

_WARNED: set[tuple[str, str]] = set()  # (prompt, option) pairs already said skipped in this process


def parse_prompt(line: str, true_cfg_only: bool = True) -> SamplePrompt:
    """A prompt with its options (module docstring); :class:`PromptError` naming the prompt and the option.
    ``true_cfg_only``: a negative prompt acts only through true CFG (``--l``), as for the guidance-distilled
    FLUX.1; False for a pipeline whose ``guidance_scale`` is classifier-free guidance (SD 1.5, SDXL, SD3, Wan, ...),
    where ``--n`` acts without ``--l``."""
    text, *parts = (" " + line.strip()).split(" --")  # the space: a line may start with an option
    values: dict = {}
    short = f"{text.strip()[:40]!r}"
    for part in parts:
        letter, _, value = part.strip().partition(" ")
        if letter in IGNORED:
            if (text.strip(), letter) not in _WARNED:  # the config's check and each run parse the same prompts
                _WARNED.add((text.strip(), letter))
                log.warning("the prompt %s sets %s (--%s), which SquareQ's sampler does not take; drawn without "
                            "it.", short, IGNORED[letter], letter)
            continue
        if letter in OPTIONS and OPTIONS[letter][0] in values and letter not in REPEATABLE:
            raise PromptError(f"the prompt {short} sets --{letter} twice; keep one.")
        if letter not in OPTIONS:
            raise PromptError(f"the prompt {short} has an option --{letter}, which is not one of "
                              f"{', '.join('--' + o for o in OPTIONS)}; remove it.")
        name, parse = OPTIONS[letter]
        try:
            parsed = parse(value.strip())
            values[name] = values.get(name, ()) + (parsed,) if letter in REPEATABLE else parsed
        except ValueError as exc:
            detail = str(exc) if "must" in str(exc) else "is not a number"
            raise PromptError(f"the prompt {short}: --{letter} {value.strip()!r} {detail}.") from None
    if not text.strip():
        raise PromptError(f"{line.strip()[:40]!r} has options but no prompt before them; write the prompt first.")
    if true_cfg_only and values.get("negative") and values.get("cfg_scale", 1.0) <= 1.0:
        raise PromptError(f"the prompt {short} has a negative prompt (--n) but no --l above 1: this model is "
                          "guidance-distilled (as FLUX.1), so a negative prompt acts only through true CFG; add e.g. "
                          "--l 4 or drop --n.")
    return SamplePrompt(text.strip(), **values)


def read_prompt_file(path: str | Path) -> list[str]:
    """The prompts of a kohya prompt file (one a line; empty and ``#`` lines skipped)."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"the prompt file {path} could not be read as UTF-8 text ({exc}); save it as UTF-8 text, "
                          "one prompt a line.") from None
    prompts = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not prompts:
        raise PromptError(f"the prompt file {path} holds no prompt; write one prompt a line.")
    for p in prompts:
        if char := refused_character(p):
            raise PromptError(f"the prompt file {path} holds the control character {char}; save it as plain text.")
    return prompts
