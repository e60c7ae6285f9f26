"""`squareq train --help` grouped by topic, one line per option (its first sentence and default), so the listing of
some ninety flags fits a screen or two; docs/cli.md renders the same sections with each option's help in full."""
from __future__ import annotations

import re

import click
from click.utils import make_default_short_help

# section: the parameter names (TrainConfig keys, and train's own) listed under it, in this order
SECTIONS = {
    "Data": ("data", "dataset_config", "num_repeats", "resolution", "trigger", "caption_ext", "caption_dropout",
             "shuffle_caption", "keep_tokens", "caption_orders", "no_upscale", "flip_aug", "masked_loss", "alpha_mask",
             "mask_dir", "control_dir", "control_resolution", "no_resize_control",
             "reg_data", "prior_loss_weight", "max_sequence_length", "cache_dir", "target_frames",
             "frame_extraction", "frame_stride", "frame_sample", "max_frames", "source_fps"),
    "Model & memory": ("model", "revision", "clip_l", "clip_g", "t5", "vae", "prefetch", "resident_blocks", "host",
                       "offload_activations",
                       "vram_budget", "host_budget", "dtype", "compute", "cuda_graphs", "compile", "attention"),
    "LoRA": ("rank", "alpha", "targets", "use_dora", "use_rslora", "lora_dropout", "lora_type", "lokr_factor"),
    "Optimizer": ("lr", "optimizer", "weight_decay", "max_grad_norm", "ema_decay", "batch_size", "grad_accum",
                  "timestep_sampling", "loss_weighting", "shift", "guidance", "seed"),
    "Schedule": ("steps", "epochs", "warmup", "schedule", "schedule_cycles", "schedule_power"),
    "Saving & resume": ("output", "save_every", "keep_last", "save_format", "title", "resume", "nan_patience"),
    "Sampling & validation": ("sample_every", "sample_prompts", "sample_seed", "sample_steps", "sample_guidance",
                              "sample_prior", "sample_decoder", "validation_data", "validation_split",
                              "validate_every"),
    "Logging": ("log", "wandb_project"),
    "Configuration": ("config_file", "print_config", "help"),
}
# set in a context's meta, e.g. by docs/cli.md's generator: each option's help in full instead of one line
FULL_HELP = "squareq.full_help"
_SHORT_DEFAULT = 40  # a longer "(default: ...)" in the help is a sentence, left to the full help
_DEFAULT_IN_HELP = re.compile(r"\s*\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)")


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence (a period followed by a space), without a "(default: ...)"."""
    text = _DEFAULT_IN_HELP.sub("", text)
    match = re.search(r"[.;](\s|$)", text)
    return text[:match.start()] if match else text


def shown_default(param: click.Parameter, ctx: click.Context, help_text: str) -> str | None:
    """The default as the listing shows it: the flag's own, else the one its help names in "(default: ...)"."""
    default = param.get_default(ctx, call=False)
    if isinstance(default, (list, tuple)):
        default = ",".join(map(str, default)) or None
    if default is None or default is False or str(default) == "Sentinel.UNSET" or param.name == "help":
        match = _DEFAULT_IN_HELP.search(help_text)
        return match.group(1) if match and len(match.group(1)) <= _SHORT_DEFAULT else None
    return str(default)


class GroupedCommand(click.Command):
    """A command whose options are listed under :data:`SECTIONS`' headings, one line each unless the context asks
    for :data:`FULL_HELP`; an option in no section is listed under "Other" (tests/test_cli_help.py allows none)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        help_option = self.get_help_option(ctx)
        by_name = {"help" if p is help_option else p.name: p for p in self.get_params(ctx)
                   if isinstance(p, click.Option) and not p.hidden}
        placed = [name for names in SECTIONS.values() for name in names]
        sections = {**SECTIONS, "Other": tuple(n for n in by_name if n not in placed)}
        full = ctx.find_root().meta.get(FULL_HELP, False)
        for title, names in sections.items():
            params = [by_name[n] for n in names if n in by_name]
            if params:
                with formatter.section(title):
                    formatter.write_dl(_rows(params, ctx, formatter, full), col_max=_COLUMN)
        if not full:
            formatter.write_paragraph()
            formatter.write_text("Each option's help in full: docs/cli.md. A config file's keys: squareq train "
                                 "--print-config.")


_COLUMN = 32  # the widest flag column; a longer flag's help goes on the line below it


def _rows(params: list[click.Option], ctx: click.Context, formatter: click.HelpFormatter,
          full: bool) -> list[tuple[str, str]]:
    """Each option's flags and its help: in full, or its first sentence cut to the line, with its default."""
    terms = [p.get_help_record(ctx)[0] for p in params]
    column = min(max(map(len, terms)), _COLUMN)
    rows = []
    for term, param in zip(terms, params):
        text = param.help or ""
        default = shown_default(param, ctx, text)
        suffix = f" [default: {default}]" if default else ""
        if full:
            rows.append((term, text.strip() + ("" if _DEFAULT_IN_HELP.search(text) else suffix)))
            continue
        width = formatter.width - formatter.current_indent - 2 if len(term) > column else \
            formatter.width - formatter.current_indent - column - 2
        room = max(width - len(suffix), 16)
        short = make_default_short_help(first_sentence(text), room)
        rows.append((term, (short if short.endswith("...") else short.rstrip(".")) + suffix))
    return rows
