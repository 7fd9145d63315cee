"""The ``"sequence_parallel"`` / ``"usp"`` keys of a DeepSpeed JSON config.

The user writes them in the same file they pass to ``deepspeed``::

    {"sequence_parallel": "usp", "sequence_parallel_size": 8,
     "usp": {"ulysses_degree": 4, "ring_degree": 2, "layout": "zigzag"}}

:func:`load_usp_config` turns that into a validated, frozen :class:`USPConfig`. It is a pure
function of its arguments (no collectives, no process groups), so every rank that calls it with
the same file raises the same :class:`USPConfigError` before any communication happens, and it logs nothing (the
degrees it chooses are not yet the final ones: ``ds_usp.initialize`` logs the layout it builds).
DeepSpeed itself does not know ``"sequence_parallel"`` and ``"usp"``; with ds-usp installed, a DeepSpeed
initialization whose config sets the key is ds-usp's or refused by name (the gates of the top-level
``_ds_usp_auto``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union, get_args, get_origin

import hjson
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError,
                      field_validator)

from ds_usp.log import log_warning
from ds_usp.splits import default_degrees, divisors, kv_heads_compatible, query_heads_fit

SP_MODES = ("usp", "ulysses", "ring")
LAYOUTS = ("contiguous", "zigzag", "balanced")  # how a sequence is cut over the ranks (ds_usp.sharding)
BACKEND_CHOICES = ("auto", "torch", "flash_attn", "flash_attn_4", "triton")  # local attention kernels
COMM_DTYPES = ("input", "fp8")  # how activations travel (ds_usp.comm.fp8_encode)
VISION_TOWER_MODES = ("replicated", "sharded")  # a VLM's vision tower (ds_usp.integration.models.vision)
OLD_KEYS = {"ring_impl": "layout"}  # old name -> key: still accepted
DEFAULT_TIMEOUT_SECONDS = 600  # a collective that waits longer than this means a peer died or stalled


def _choices(values: tuple) -> str:
    return "one of " + ", ".join(map(repr, values))


class USPConfigError(ValueError):
    """A ``sequence_parallel`` / ``usp`` config value is invalid; the message names the JSON key."""


def _key(default: Any, valid: str, meaning: str, **constraints: Any) -> Any:
    """A ``"usp"`` key: its default, what is valid (for messages and docs) and what it means (for docs)."""
    return Field(default=default, description=meaning, json_schema_extra={"valid": valid}, **constraints)


class USPSettings(BaseModel):
    """Schema of the optional ``"usp"`` block: the one source of every key's type, default, valid values and
    meaning. Validation messages, the key table of docs/config.md (:func:`reference_table`) and the attributes of
    :class:`USPConfig` come from it; ``activation_checkpointing: true`` is read as ``"selective"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ulysses_degree: Optional[StrictInt] = _key(
        None, "a positive integer", "ranks of one all-to-all group; divides `sequence_parallel_size` and the "
        "attention heads (default: chosen, see Automatic degrees)", ge=1)
    ring_degree: Optional[StrictInt] = _key(
        None, "a positive integer", "ranks of one K/V ring; divides `sequence_parallel_size` (default: the rest)",
        ge=1)
    layout: Literal[LAYOUTS] = _key(  # type: ignore[valid-type]
        "zigzag", _choices(LAYOUTS), "how the sequence is cut over the ranks: `zigzag` balances causal work over "
        "the ring, `balanced` does so per packed document, `contiguous` gives each rank one slice (old name: "
        "`ring_impl`)")
    attn_backend: Literal[BACKEND_CHOICES] = _key(  # type: ignore[valid-type]
        "auto", _choices(BACKEND_CHOICES), "local attention kernel")
    native_op: Union[Literal["auto"], StrictBool] = _key(
        "auto", "'auto', true or false", "the JIT-built native op for the merge, packing and accumulation")
    comm_dtype: Literal[COMM_DTYPES] = _key(  # type: ignore[valid-type]
        "input", _choices(COMM_DTYPES), "dtype of the activations on the wire: `input` sends them as they are "
        "(exact); `fp8` sends the attention's forward all-to-alls and the ring's K/V blocks as float8 e4m3 with one "
        "fp32 scale per token and head (2-5% error on the attention output; gradients stay in the training dtype; "
        "docs/benchmarks.md has the loss curves)")
    timeout_seconds: Union[StrictInt, StrictFloat] = _key(
        DEFAULT_TIMEOUT_SECONDS, "a positive number of seconds", "timeout of every collective on the USP groups",
        gt=0, allow_inf_nan=False)
    chunked_loss: Union[Literal["auto"], StrictBool] = _key(
        "auto", "'auto', true or false", "logits and loss through `lm_head` in chunks, never the whole logits (auto: "
        "when the whole logits would not fit `memory_gib`; the chunk is as large as fits, a multiple of 128 rows)")
    tiled_mlp: Union[Literal["auto"], StrictBool] = _key(
        "auto", "'auto', true or false", "each decoder layer's MLP over sequence tiles, recomputed per tile in the "
        "backward (auto: when it is the fastest way to fit `memory_gib`, in as few tiles as fit)")
    activation_checkpointing: Union[Literal["auto", "selective", "full"], StrictBool] = _key(
        "auto", "'auto', 'selective', 'full', true (selective) or false", "per decoder layer: `selective` keeps "
        "the ring attention's result and recomputes the rest, `full` recomputes everything; a mode given applies to "
        "every layer (auto: selective or full for only as many layers as `memory_gib` needs, none when it fits)")
    offload_activations: Union[Literal["auto"], StrictBool] = _key(
        "auto", "'auto', true or false", "checkpointed layer inputs wait in host memory, copied on a side stream "
        "(auto: on a GPU, when the step does not fit `memory_gib` otherwise; a no-op on CPU)")
    memory_gib: Optional[Union[StrictInt, StrictFloat]] = _key(
        None, "a positive number of GiB", "the memory one rank may use, model states and (on CPU) the process "
        "included: the `auto` features are the fastest that fit 90% of what the rank does not hold yet; a value no "
        "plan fits is refused by name (default: a GPU's memory; on CPU the host's available memory shared by the "
        "node's ranks)", gt=0, allow_inf_nan=False)
    vision_tower: Literal[VISION_TOWER_MODES] = _key(  # type: ignore[valid-type]
        "replicated", _choices(VISION_TOWER_MODES), "a VLM's vision tower: `replicated` encodes every image and "
        "frame on every rank; `sharded` runs each block of a tower that packs its patches with `cu_seqlens` "
        "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on the rank's shard of the patches, its attention USP over the group "
        "(pays from long videos on: docs/models.md)")
    dynamic_sp: StrictBool = _key(
        False, "true or false", "also build the groups of every smaller sequence-parallel degree (a divisor of "
        "`sequence_parallel_size`), so that a micro batch's rows can run on fewer ranks each "
        "(`ds_usp.shard_batch(rows, engine.usp.topo.degrees[d])`); losses stay averaged over the whole SP group")
    async_save: StrictBool = _key(
        False, "true or false", "`engine.save_checkpoint` pauses training only to copy the state; a background "
        "thread writes the files, and the manifest and `latest` follow once every rank's files are on disk "
        "(docs/reliability.md)")
    tile_mib: Optional[Union[StrictInt, StrictFloat]] = _key(
        None, "a positive number of MiB", "the most a loss chunk's fp32 logits and an MLP tile's backward may take "
        "(default: as much as `memory_gib` allows)", gt=0, allow_inf_nan=False)

    @field_validator("activation_checkpointing")
    @classmethod
    def _true_is_selective(cls, value: Any) -> Any:
        return "selective" if value is True else value


def _valid(key: str) -> str:
    return USPSettings.model_fields[key].json_schema_extra["valid"]


_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number"}


def _type_name(key: str) -> str:
    """The JSON type(s) a key takes, read from its annotation (``Literal`` values, strict numbers, ``Optional``)."""
    names: list[str] = []

    def walk(annotation: Any) -> None:
        args = get_args(annotation)
        if get_origin(annotation) is Literal:
            for value in args:
                walk(type(value))
        elif args:  # Union / Optional / Annotated (pydantic's strict types)
            for arg in args:
                walk(arg)
        elif annotation in _JSON_TYPES and _JSON_TYPES[annotation] not in names:
            names.append(_JSON_TYPES[annotation])

    walk(USPSettings.model_fields[key].annotation)
    return "number" if names == ["integer", "number"] else " or ".join(names)


_TOP_KEYS = (  # (key, type, default, valid values, meaning): the keys outside the "usp" block
    ("sequence_parallel", "string", "absent: off", _choices(SP_MODES),
     "turns sequence parallelism on: `ulysses` forces `ring_degree` 1, `ring` forces `ulysses_degree` 1"),
    ("sequence_parallel_size", "integer", "the world size", "a divisor of the world size",
     "ranks that share one sequence (DeepSpeed's key); the rest is data parallelism"),
    ("usp", "object", "`{}`", "the keys below, nothing else", "the USP settings"),
)


def reference_table() -> str:
    """The key table of docs/config.md, rendered from the schema (tests/test_config_topology.py checks the docs).

    Returns:
        A Markdown table: key, type, default, valid values, meaning.
    """
    rows = ["| key | type | default | valid values | meaning |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{k}` | {t} | {d} | {v} | {m} |" for k, t, d, v, m in _TOP_KEYS]
    for key, info in USPSettings.model_fields.items():
        default = "chosen" if info.default is None else f"`{json.dumps(info.default)}`"
        rows.append(f"| `usp.{key}` | {_type_name(key)} | {default} | {_valid(key)} | {info.description} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class USPConfig:
    """Validated sequence-parallel settings: the layout over the ranks, and the ``"usp"`` keys.

    Every ``"usp"`` key reads as an attribute (``cfg.layout``, ``cfg.chunked_loss``...) of :attr:`settings`, the
    validated block with its defaults; the degrees are this config's own (resolved, never None).

    Attributes:
        mode: ``"usp"``, ``"ulysses"``, ``"ring"``, or ``None`` when sequence parallelism is off.
        world_size: ranks in the job.
        sequence_parallel_size: ranks that share one sequence (``ulysses_degree * ring_degree``).
        ulysses_degree: ranks in one all-to-all (Ulysses) group.
        ring_degree: ranks in one K/V ring.
        data_parallel_size: ``world_size // sequence_parallel_size``.
        degrees_chosen_automatically: True when the degrees were not given and were chosen here.
        settings: the ``"usp"`` block (:class:`USPSettings`).
    """

    mode: Optional[str]
    world_size: int
    sequence_parallel_size: int
    ulysses_degree: int
    ring_degree: int
    data_parallel_size: int
    degrees_chosen_automatically: bool = False
    settings: USPSettings = USPSettings()

    def __getattr__(self, name: str) -> Any:
        """A ``"usp"`` key, from :attr:`settings`."""
        if name != "settings" and name in USPSettings.model_fields:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def enabled(self) -> bool:
        """True when sequence parallelism is on (``"sequence_parallel"`` was given)."""
        return self.mode is not None


def read_ds_config(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> Mapping[str, Any]:
    """Read a DeepSpeed config given as a path or a dict.

    Args:
        ds_config: a JSON file path or an already-parsed dict.

    Returns:
        The config as a mapping.

    Raises:
        USPConfigError: missing file, invalid JSON or a wrong type.
    """
    if isinstance(ds_config, Mapping):
        return ds_config
    if isinstance(ds_config, (str, os.PathLike)):
        path = Path(ds_config)
        if not path.is_file():
            raise USPConfigError(f"DeepSpeed config file {str(path)!r} does not exist")
        try:
            # The same parser DeepSpeed uses (hjson: comments and trailing commas are fine), so a file
            # DeepSpeed accepts is read identically here.
            return hjson.loads(path.read_text(), object_pairs_hook=dict)
        except hjson.HjsonDecodeError as e:
            raise USPConfigError(f"DeepSpeed config file {str(path)!r} is not valid JSON/hjson: {e}") from e
    raise USPConfigError(f"ds_config must be a path or a dict, got {type(ds_config).__name__}")


def _explain(err: ValidationError, written: Mapping[str, str]) -> str:
    """Turn pydantic's errors into one message per key: ``usp.<key> (<value>) ... must be <valid>``.

    ``written`` maps a key to the old name the user wrote it under (the message then names both).
    """
    lines: dict[str, str] = {}
    for e in err.errors():
        key = str(e["loc"][0])
        name = f"usp.{written[key]} (the old name of usp.{key})" if key in written else f"usp.{key}"
        if e["type"] == "extra_forbidden":
            lines[key] = f"usp.{key} is not a known key; valid keys are: {', '.join(USPSettings.model_fields)}"
        elif key == "layout" and e.get("input") == "basic":
            lines[key] = f"{name} ('basic') is the old name of 'contiguous': write \"layout\": \"contiguous\""
        else:
            lines.setdefault(key, f"{name} ({e.get('input')!r}) is invalid: must be {_valid(key)}")
    return "; ".join(lines.values())


def _renamed(block: Mapping[str, Any]) -> dict[str, Any]:
    """The ``"usp"`` block with old key names (:data:`OLD_KEYS`) under their current names.

    Raises:
        USPConfigError: an old and a current name both given, with different values.
    """
    out = dict(block)
    for old, new in OLD_KEYS.items():
        if old in out:
            value = out.pop(old)
            if new in out and out[new] != value:
                raise USPConfigError(f"usp.{old} ({value!r}) is the old name of usp.{new} ({out[new]!r}): give one of "
                                     f"them")
            out[new] = value
    return out


# Where launchers say how many ranks run on this node, the first one set wins. The deepspeed launcher's LOCAL_SIZE comes
# first: accelerate, run inside it with TrainingArguments(use_cpu=True), writes LOCAL_WORLD_SIZE=1 (its CPU default)
# over nothing; MPI launchers' own variables next; torchrun's (and accelerate launch's) LOCAL_WORLD_SIZE; SLURM's last
# (srun sets them for its tasks, but a launcher started by srun once per node, torchrun or deepspeed, sets its own
# above them): SLURM_NTASKS_PER_NODE (only with --ntasks-per-node), SLURM_TASKS_PER_NODE ("8(x2),4": this node's
# entry, by SLURM_NODEID).
LOCAL_SIZE_VARIABLES = ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE",
                        "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _slurm_tasks_on_this_node(value: str) -> str:
    """This node's count in SLURM's ``SLURM_TASKS_PER_NODE`` (``"8(x2),4"``: 8 tasks on each of the first two nodes,
    4 on the third), by ``SLURM_NODEID``; ``""`` when the value cannot be read."""
    counts: list[str] = []
    for part in value.split(","):
        count, _, repeat = part.strip().partition("(x")
        repeat = repeat.rstrip(")") or "1"
        if not (count.isdigit() and repeat.isdigit()):
            return ""
        counts += [count] * int(repeat)
    node = os.environ.get("SLURM_NODEID", "0")
    index = int(node) if node.isdigit() else 0
    return counts[index] if index < len(counts) else ""


def ranks_per_node_and_source(world_size: int) -> tuple[int, str]:
    """Ranks on this node and the launcher variable that said so (:data:`LOCAL_SIZE_VARIABLES`, the first set).

    Args:
        world_size: the answer when no launcher variable is set (a single node).

    Returns:
        ``(ranks, variable)``; the variable is ``"no launcher variable"`` for the fallback.
    """
    for var in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(var, "")
        if var == "SLURM_TASKS_PER_NODE":
            value = _slurm_tasks_on_this_node(value)
        if value.isdigit() and int(value) > 0:
            return int(value), var
    return world_size, "no launcher variable"


def ranks_per_node(world_size: int) -> int:
    """Ranks on this node, as the launcher says: ``LOCAL_SIZE`` (deepspeed), an MPI launcher's,
    ``LOCAL_WORLD_SIZE`` (torchrun, accelerate launch) or SLURM's (srun); see :func:`ranks_per_node_and_source`.

    Args:
        world_size: the fallback when no launcher variable is set (a single node).

    Returns:
        The number of ranks per node.
    """
    return ranks_per_node_and_source(world_size)[0]


def process_group_timeout(ds_config: Mapping[str, Any]) -> Optional[float]:
    """``usp.timeout_seconds`` of a parsed config (default when absent or invalid), None when SP is off.

    It never raises, so that every rank can create its process groups with it before
    :func:`load_usp_config` reports a bad config the same way on every rank.

    Args:
        ds_config: the parsed DeepSpeed config.

    Returns:
        Seconds, or None when ``"sequence_parallel"`` is not set (DeepSpeed's own default applies).
    """
    if ds_config.get("sequence_parallel") is None:
        return None
    block = ds_config.get("usp", {})
    try:
        return float(USPSettings(**_renamed(block)).timeout_seconds) if isinstance(block, Mapping) else DEFAULT_TIMEOUT_SECONDS
    except (ValidationError, TypeError, USPConfigError):
        return DEFAULT_TIMEOUT_SECONDS


def _sequence_parallel_size(cfg: Mapping[str, Any], world_size: int) -> int:
    """``sequence_parallel_size``, checked against the world size.

    Raises:
        USPConfigError: not a positive integer, or not a divisor of ``world_size``.
    """
    sp = cfg.get("sequence_parallel_size", world_size)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise USPConfigError(f"sequence_parallel_size ({sp!r}) must be a positive integer")
    if world_size % sp != 0:
        valid = ", ".join(str(d) for d in divisors(world_size))
        raise USPConfigError(f"sequence_parallel_size ({sp}) must divide the world size ({world_size}); "
                             f"valid values here: {valid}")
    return sp


def _usp_block(cfg: Mapping[str, Any]) -> USPSettings:
    """The validated ``"usp"`` block (old key names read under their current ones).

    Raises:
        USPConfigError: not an object, or a key invalid (:func:`_explain`).
    """
    raw_block = cfg.get("usp", {})
    if not isinstance(raw_block, Mapping):
        raise USPConfigError(f"usp ({raw_block!r}) must be a JSON object")
    written = {new: old for old, new in OLD_KEYS.items() if old in raw_block}
    try:
        return USPSettings(**_renamed(raw_block))
    except ValidationError as e:
        raise USPConfigError(_explain(e, written)) from None


def _given_degrees(mode: str, sp: int, block: USPSettings) -> tuple[Optional[int], Optional[int]]:
    """``(U, R)`` as the config gives them (None: left out), the mode's forced degree applied.

    Raises:
        USPConfigError: a degree the mode forbids, a product other than ``sp``, or a degree not dividing ``sp``.
    """
    u, r = block.ulysses_degree, block.ring_degree
    if mode == "ulysses":
        if r not in (None, 1):
            raise USPConfigError(f'usp.ring_degree ({r}) must be 1 (or left out) when "sequence_parallel" is "ulysses"')
        r = 1
        u = sp if u is None else u
    elif mode == "ring":
        if u not in (None, 1):
            raise USPConfigError(f'usp.ulysses_degree ({u}) must be 1 (or left out) when "sequence_parallel" is "ring"')
        u = 1
        r = sp if r is None else r

    if u is not None and r is not None and u * r != sp:
        raise USPConfigError(f"usp.ulysses_degree ({u}) x usp.ring_degree ({r}) = {u * r} must equal "
                             f"sequence_parallel_size ({sp})")
    for key, val in (("ulysses_degree", u), ("ring_degree", r)):
        if val is not None and sp % val != 0:
            valid = ", ".join(str(d) for d in divisors(sp))
            raise USPConfigError(f"usp.{key} ({val}) must divide sequence_parallel_size ({sp}); "
                                 f"valid values: {valid}")
    return u, r


def _check_heads(mode: str, sp: int, u: int, num_heads: Optional[int], num_kv_heads: Optional[int]) -> None:
    """Refuse a Ulysses degree the model's heads cannot split (:mod:`ds_usp.splits`), naming the config's keys.

    Raises:
        USPConfigError: the query heads not divisible by ``u``, or kv heads incompatible with it.
    """
    if num_heads is not None and not query_heads_fit(num_heads, u) and mode == "ulysses":
        raise USPConfigError(f'"sequence_parallel": "ulysses" puts all {sp} sequence-parallel ranks in one Ulysses '
                             f'group, but {sp} does not divide the number of attention heads ({num_heads}); use '
                             f'"sequence_parallel": "usp" (the rest becomes ring) or a sequence_parallel_size that '
                             f'divides {num_heads}')
    if num_heads is not None and not query_heads_fit(num_heads, u):
        valid = ", ".join(str(d) for d in divisors(sp) if query_heads_fit(num_heads, d))
        raise USPConfigError(f"usp.ulysses_degree ({u}) must divide the number of attention heads ({num_heads}); "
                             f"valid values: {valid}")
    if num_kv_heads is not None and not kv_heads_compatible(num_kv_heads, u):
        raise USPConfigError(f"usp.ulysses_degree ({u}) is incompatible with {num_kv_heads} kv heads: kv heads "
                             f"must be a multiple or a divisor of ulysses_degree")


def load_usp_config(
    ds_config: Union[str, os.PathLike, Mapping[str, Any]],
    world_size: int,
    local_world_size: Optional[int] = None,
    *,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
) -> USPConfig:
    """Read and validate the sequence-parallel keys of a DeepSpeed config.

    Args:
        ds_config: the DeepSpeed JSON config, as a path or an already-parsed dict.
        world_size: total number of ranks.
        local_world_size: ranks per node; ``None`` reads the launcher's (:func:`ranks_per_node`, falling back to
            ``world_size``). Only used when the degrees are chosen automatically.
        num_heads: query heads of the model, when known (checked against ``ulysses_degree``).
        num_kv_heads: key/value heads of the model, when known.

    Returns:
        The validated :class:`USPConfig`; ``config.enabled`` is False when ``"sequence_parallel"``
        is absent.

    Raises:
        USPConfigError: (a ``ValueError``) naming the key, the value and what would be valid.
    """
    cfg = read_ds_config(ds_config)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise USPConfigError(f"world_size ({world_size!r}) must be a positive integer")

    mode = cfg.get("sequence_parallel")
    if mode is None:
        if "usp" in cfg:
            log_warning('the "usp" block is ignored because "sequence_parallel" is not set; '
                        f'set "sequence_parallel" to one of {", ".join(map(repr, SP_MODES))} to use it')
        return USPConfig(mode=None, world_size=world_size, sequence_parallel_size=1, ulysses_degree=1,
                         ring_degree=1, data_parallel_size=world_size)
    if mode not in SP_MODES:
        raise USPConfigError(f"sequence_parallel ({mode!r}) is invalid: must be {_choices(SP_MODES)} "
                             f"(or leave the key out to disable it)")

    sp = _sequence_parallel_size(cfg, world_size)
    block = _usp_block(cfg)
    u, r = _given_degrees(mode, sp, block)
    chosen = u is None and r is None
    if chosen:
        if local_world_size is None:
            local_world_size = ranks_per_node(world_size)
        u, r = default_degrees(sp, local_world_size, num_heads, num_kv_heads)
    elif u is None:
        u = sp // r
    elif r is None:
        r = sp // u
    _check_heads(mode, sp, u, num_heads, num_kv_heads)

    return USPConfig(mode=mode, world_size=world_size, sequence_parallel_size=sp, ulysses_degree=u,
                     ring_degree=r, data_parallel_size=world_size // sp, degrees_chosen_automatically=chosen,
                     settings=block)
