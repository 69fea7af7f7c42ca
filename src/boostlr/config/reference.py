"""The config reference, ``docs/config.md``, generated from the schema's field docstrings.

The schema is the one place a key is described: each field's docstring in
:mod:`boostlr.config.schema` becomes its entry here, with the type, the default and the
allowed values read from the dataclasses themselves, so the page cannot drift from the code.
Regenerate it after changing the schema with :data:`REGENERATE`; ``tests/test_docs.py``
fails while the checked-in page differs from :func:`reference_markdown`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import Any

from boostlr.config import schema

REGENERATE = "PYTHONPATH=src python -m boostlr.config.reference > docs/config.md"

# Where a key's behaviour is explained at length (paths relative to docs/).
SEE_ALSO: dict[str, tuple[str, str]] = {
    "model.arch": ("the models", "design.md#1-the-models"),
    "model.lax_gate": ("the models", "design.md#1-the-models"),
    "model.tie_embeddings": (
        "embedding, LM head and loss",
        "design.md#28-embedding-lm-head-and-loss",
    ),
    "data.path": ("data", "data.md"),
    "data.default_vocab": ("data", "data.md#the-default-corpus"),
    "data.val_batches": ("evaluation", "export-and-eval.md#evaluation"),
    "train.global_batch": ("global batch", "parallelism.md#3d-parallelism"),
    "train.seed": ("initialisation without the full model", "parallelism.md#3d-parallelism"),
    "train.dtype": ("tensor parallelism", "parallelism.md#tensor-parallelism"),
    "train.ckpt_every": ("checkpoints", "checkpoints.md#checkpoints"),
    "train.keep_checkpoints": ("checkpoints", "checkpoints.md#checkpoints"),
    "train.async_ckpt": ("checkpoints", "checkpoints.md#checkpoints"),
    "train.save_on_signal": ("stopping early", "checkpoints.md#stopping-early-and-resuming"),
    "train.time_limit": ("stopping early", "checkpoints.md#stopping-early-and-resuming"),
    "train.compile": ("speed and profiling", "speed-and-memory.md"),
    "train.profile_steps": ("speed and profiling", "speed-and-memory.md"),
    "train.memory_phases": ("speed and profiling", "speed-and-memory.md"),
    "train.cpu_alloc_cache": ("speed and profiling", "speed-and-memory.md"),
    "train.fused_loss": ("speed and profiling", "speed-and-memory.md"),
    "train.tensorboard": ("logging and plots", "metrics.md#logging-and-plots"),
    "train.wandb": ("logging and plots", "metrics.md#logging-and-plots"),
    "parallel.device": ("running on GPUs and clusters", "cluster.md"),
    "parallel.nproc": ("running on GPUs and clusters", "cluster.md"),
    "parallel.tp": ("tensor parallelism", "parallelism.md#tensor-parallelism"),
    "parallel.tp_strategy": ("tensor parallelism", "parallelism.md#tensor-parallelism"),
    "parallel.norm": ("online-RMSNorm", "design.md#24-online-rmsnorm"),
    "parallel.grouping": ("linear-layer grouping", "design.md#25-linear-layer-grouping"),
    "parallel.tp_overlap": (
        "overlapping the latent all-reduce",
        "design.md#26-overlapping-the-latent-all-reduce-with-b",
    ),
    "parallel.act_ckpt": (
        "low-rank activation checkpointing",
        "design.md#27-low-rank-activation-checkpointing",
    ),
    "parallel.dp": ("3D parallelism", "parallelism.md#3d-parallelism"),
    "parallel.dp_mode": ("3D parallelism", "parallelism.md#3d-parallelism"),
    "parallel.vocab_dp": ("the vocabulary over dp", "design.md#46-the-vocabulary-over-dp"),
    "parallel.pp": ("3D parallelism", "parallelism.md#3d-parallelism"),
    "parallel.pp_schedule": ("3D parallelism", "parallelism.md#3d-parallelism"),
    "parallel.microbatches": ("3D parallelism", "parallelism.md#3d-parallelism"),
    "parallel.pp_virtual": ("3D parallelism", "parallelism.md#3d-parallelism"),
    "parallel.max_restarts": ("checkpoints", "checkpoints.md#checkpoints"),
    "parallel.timeout_s": ("checkpoints", "checkpoints.md#checkpoints"),
    "parallel.pin_cores": ("running on GPUs and clusters", "cluster.md"),
}

_SECTION_CLASSES: dict[str, type] = {
    f.name: typing.get_type_hints(schema.RunConfig)[f.name]
    for f in dataclasses.fields(schema.RunConfig)
}


@functools.cache
def _docstrings() -> dict[str, dict[str, str]]:
    """Class name -> {"": class docstring, field: the string literal right under it}."""
    tree = ast.parse(inspect.getsource(schema))
    found: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = {"": ast.get_docstring(node) or ""}
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
        found[node.name] = docs
    return found


def _markdown(text: str) -> str:
    """reST inline literals (````x````) as Markdown code spans."""
    return text.replace("``", "`")


def _type_name(annotation: Any) -> tuple[str, tuple[str, ...]]:
    """(type in TOML words, allowed values or ())."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "string", tuple(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        options = [a for a in args if a is not type(None)]
        if type(None) in args:
            name, allowed = _type_name(options[0])
            return f"{name}, optional", allowed
        # ``bool | Literal["auto"]``: a boolean or a fixed word
        names, allowed = [], []
        for option in options:
            name, values = _type_name(option)
            names.append(name)
            allowed += values or (["true", "false"] if option is bool else [])
        return " or ".join(names), tuple(allowed)
    names = {bool: "boolean", int: "integer", float: "float", str: "string"}
    return names[annotation], ()


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _anchor(key: str) -> str:
    """GitHub's heading slug of a ``### `key``` heading."""
    return re.sub(r"[^\w\- ]", "", key.lower()).replace(" ", "-")


def _allowed(key: str, annotation: Any) -> tuple[str, ...]:
    if key == "model.preset":
        return tuple(schema.PRESETS)
    if annotation is bool:
        return ("true", "false")
    return _type_name(annotation)[1]


def _presets_table() -> list[str]:
    rows = [
        "| preset | dim | ffn_dim | n_layers | n_heads | n_kv_heads | vocab_size (planning) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in schema.PRESETS.items():
        rows.append(
            f"| `{name}` | {p.dim} | {p.ffn_dim} | {p.n_layers} | {p.n_heads} | "
            f"{p.n_kv_heads} | {p.vocab_size} |"
        )
    return rows


def reference_markdown() -> str:
    """The whole of ``docs/config.md``."""
    docs = _docstrings()
    out = [
        "# Config reference",
        "",
        "<!-- Generated from the field docstrings in src/boostlr/config/schema.py by",
        f"     {REGENERATE}",
        "     Edit the docstrings, not this file: tests/test_docs.py fails while it is stale. -->",
        "",
        "Every key can be set in a TOML file (`[model]`, `[data]`, `[train]`, `[parallel]`",
        "tables) or on the command line as `--section.key VALUE` (or `--section.key=VALUE`);",
        "command-line overrides apply on top of the TOML file. The resolved config is saved as",
        "`config.toml` in the run directory. `boostlr plan` reads a config exactly as `train`",
        "does; `eval` and `import-hf` take some of these keys as overrides. Booleans also accept",
        "`on`/`off`, `yes`/`no` and `1`/`0`; an optional key is unset",
        "by leaving it out (or `none` on the command line). An unknown key, a value of the wrong",
        "type or one outside the allowed values is a one-line error (exit code 2).",
        "",
    ]
    for section, cls in _SECTION_CLASSES.items():
        out.append(f"- [`[{section}]`](#{section}): {_markdown(docs[cls.__name__][''])}")
    for section, cls in _SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        out += ["", f"## {section}", "", _markdown(docs[cls.__name__][""]), ""]
        out += ["| key | type | default |", "|---|---|---|"]
        for f in fields:
            key = f"{section}.{f.name}"
            out.append(
                f"| [`{key}`](#{_anchor(key)}) | {_type_name(hints[f.name])[0]} "
                f"| {_default(f.default)} |"
            )
        if section == "model":
            out += ["", "The presets:", "", *_presets_table()]
        for f in fields:
            key = f"{section}.{f.name}"
            doc = docs[cls.__name__].get(f.name)
            if not doc:
                raise ValueError(f"{key} has no docstring in schema.py: add one under the field")
            type_name, _ = _type_name(hints[f.name])
            allowed = _allowed(key, hints[f.name])
            out += [
                "",
                f"### `{key}`",
                "",
                f"- type: {type_name}",
                f"- default: {_default(f.default)}",
            ]
            if allowed:
                out.append("- allowed: " + ", ".join(f"`{a}`" for a in allowed))
            out += ["", _markdown(doc)]
            if key in SEE_ALSO:
                title, target = SEE_ALSO[key]
                out += ["", f"See [{title}]({target})."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
