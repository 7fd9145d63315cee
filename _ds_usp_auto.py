"""ds-usp's switch for programs that never import it: a DeepSpeed config with ``"sequence_parallel"`` is honoured or
refused by name wherever DeepSpeed is initialized (the stock HF ``Trainer``, TRL's ``SFTTrainer`` and ``trl sft``,
``accelerate launch``, a plain ``deepspeed.initialize``).

Installing ds-usp puts ``ds_usp_auto.pth`` in site-packages (and ``ds_usp_auto.start``, the same entry point for
Python 3.15's PEP 829); at interpreter start it calls :func:`install`, which puts one finder at the front of
``sys.meta_path``, as setuptools' ``distutils-precedence.pth`` and virtualenv's ``_virtualenv.pth`` do. The finder
answers only for four module names; for every other import it returns ``None`` after one dictionary lookup, and it
imports nothing. When one of the four has been imported, it wraps one function of it with a gate:

* ``deepspeed``: ``deepspeed.initialize``;
* ``deepspeed.runtime.config``: ``DeepSpeedConfig.__init__`` (where DeepSpeed first reads the batch size, in
  ``zero.Init`` before any ``deepspeed.initialize``: a batch counted over every rank is counted over replicas);
* ``transformers.integrations.deepspeed``: ``HfTrainerDeepSpeedConfig.trainer_config_process`` (where HF fills the
  config's ``"auto"`` values, when ``TrainingArguments`` is created);
* ``transformers.trainer``: ``Trainer.create_accelerator_and_postprocess`` (called in ``Trainer.__init__`` before
  any data loader exists).

A gate reads the DeepSpeed config of the call. Without ``"sequence_parallel"`` it calls the wrapped function
unchanged, having imported nothing. With the key it calls its handler from :data:`HANDLERS`, a table this module
holds and the package named by :data:`PROVIDER` fills (:func:`serve`) when it is imported; a gate imports that
package by name when the table is still empty. The bootstrap knows nothing else of the package, and the package's
checked patches (``ds_usp/upstream/``, registered in its ``PATCHES`` table, the gates' wraps included) do the
work: ``ds_usp.initialize`` instead of DeepSpeed's, the batch size counted over replicas, the Trainer turned into
ds-usp's. ``import ds_usp`` fills the table and calls :func:`install` too, so the gates are the same whether or not
the ``.pth`` ran (``python -S``, a source checkout on ``PYTHONPATH``), and there is one wrapper of each function,
never two stacked.

The off switch, ``DS_USP_AUTO=0`` (also ``false``, ``no``, ``off``), is read when a gate meets the key, not at start:
a program that does not import ds-usp is then refused by name instead of silently training without sequence
parallelism (or failing in DeepSpeed's batch-size assertion), and a program that imports ds-usp keeps what it asked
for by name (``ds_usp.initialize``, ``ds_usp.USPTrainer``; a plain Trainer is refused). Configs without the key run
exactly as before either way. ``pip uninstall ds-usp`` removes the ``.pth`` with the package.

This module imports only ``os`` and ``sys`` at start (its annotations are strings, so not even ``typing``); the gates
import ``functools``, ``inspect`` and ``json`` when they act, ds-usp only when a config sets the key.
"""
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # the names of the annotations; typing itself is not imported at interpreter start
    from typing import Any, Callable, Optional

SWITCH = "DS_USP_AUTO"
KEY = "sequence_parallel"
_MARK = "_ds_usp"  # on every function a gate wraps: DeepSpeed's / HF's own is its __wrapped__


def auto_enabled() -> bool:
    """Whether ds-usp takes the ``"sequence_parallel"`` key in programs that do not import it (``DS_USP_AUTO``).

    Returns:
        False when ``DS_USP_AUTO`` is ``0``, ``false``, ``no`` or ``off``; True otherwise (also when it is unset).
    """
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class _Loader:
    """The loader of a watched module: the module's own loader executes it, then the watcher's callbacks run."""

    def __init__(self, loader: "Any", watcher: "_Watcher") -> None:
        self.loader = loader
        self.watcher = watcher

    def create_module(self, spec: "Any") -> "Any":
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: "Any") -> None:
        spec = module.__spec__
        spec.loader = module.__loader__ = self.loader  # the module keeps its own loader (source, reload)
        self.loader.exec_module(module)  # the module runs completely first
        self.watcher.imported(spec.name, module)

    def __getattr__(self, name: str) -> "Any":
        return getattr(self.loader, name)


class _Watcher:
    """A ``sys.meta_path`` finder that answers only for watched module names: it finds their spec with the other
    finders and runs the callbacks right after the module executed."""

    _ds_usp_watcher = True  # found by this name, also from another copy of this module

    def __init__(self) -> None:
        self.callbacks: "dict[str, list[Callable[[Any], None]]]" = {}
        self._finding: "set[str]" = set()

    def find_spec(self, fullname: str, path: "Any" = None, target: "Any" = None) -> "Any":
        """The spec the other finders give for a watched name, its loader wrapped; None for any other name."""
        if fullname not in self.callbacks or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None) if finder is not self else None
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module") and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def imported(self, name: str, module: "Any") -> None:
        """Run the callbacks of ``name`` on the module just imported."""
        for callback in list(self.callbacks.get(name, ())):
            _run(callback, name, module)


def _run(callback: "Callable[[Any], None]", name: str, module: "Any") -> None:
    """``callback(module)``; one that fails says so on stderr and never breaks the program's import."""
    try:
        callback(module)
    except Exception as e:  # noqa: BLE001 - the program imported a library, not ds-usp
        sys.stderr.write(f"ds-usp: {getattr(callback, '__name__', callback)} on {name} failed ({type(e).__name__}: "
                         f"{e}); a DeepSpeed config with \"{KEY}\" is not handled there\n")


def _watcher() -> "_Watcher":
    for finder in sys.meta_path:
        if getattr(finder, "_ds_usp_watcher", False):
            return finder
    watcher = _Watcher()
    sys.meta_path.insert(0, watcher)
    return watcher


def when_imported(name: str, callback: "Callable[[Any], None]") -> None:
    """Run ``callback(module)`` once module ``name`` is imported: now if it already is, else right after its import
    (and again after a reload). Installs the finder when it is not yet there.

    Args:
        name: the module's full name.
        callback: called with the module; the same callback is registered once.
    """
    watcher = _watcher()
    callbacks = watcher.callbacks.setdefault(name, [])
    if callback in callbacks:
        return  # registered before: it already ran on a module imported then
    callbacks.append(callback)
    if name in sys.modules:
        _run(callback, name, sys.modules[name])


# ---- reading the DeepSpeed config of a call (no ds-usp import) ------------------------------------------------------

def _parsed(source: "Any") -> "Optional[Any]":
    """The config a DeepSpeed call reads: a mapping as given, a file's JSON (hjson, as DeepSpeed reads it); None when
    it is neither (DeepSpeed reports its own errors)."""
    if hasattr(source, "get"):
        return source
    if not isinstance(source, (str, os.PathLike)) or not os.path.isfile(source):
        return None
    try:
        with open(source) as f:
            text = f.read()
    except OSError:
        return None
    if KEY not in text:
        return {}
    import json

    try:
        return json.loads(text)
    except ValueError:
        try:
            import hjson

            return hjson.loads(text)
        except Exception:  # noqa: BLE001 - not a config; DeepSpeed says why
            return None


def sets_key(config: "Any") -> bool:
    """Whether a DeepSpeed config (a mapping or a path) sets ``"sequence_parallel"``."""
    config = _parsed(config)
    return config is not None and hasattr(config, "get") and config.get(KEY) is not None


def _refuse_off(where: str) -> None:
    raise ValueError(f'the DeepSpeed config sets "{KEY}", but ds-usp\'s automatic switch is off ({SWITCH}='
                     f'{os.environ.get(SWITCH)}), so {where} would ignore the key and train without sequence '
                     f'parallelism. Unset {SWITCH} to let ds-usp take the key, or import ds_usp in the program and use '
                     f'ds_usp.initialize / ds_usp.USPTrainer, or remove "{KEY}" to train without sequence parallelism')


# ---- the handler table: what a gate calls when a config sets the key -------------------------------------------------

PROVIDER = "ds_usp"  # the package that fills HANDLERS when it is imported; the bootstrap imports nothing of it
HANDLERS: "dict[str, Callable[..., Any]]" = {}  # gate name -> handler, filled by the provider through serve()


def serve(handlers: "dict[str, Callable[..., Any]]") -> None:
    """Fill the handler table (the provider calls it when it is imported; a gate whose key is set calls its handler).

    Args:
        handlers: ``{"deepspeed.initialize": f(original, call), "deepspeed_config": f(original, config_object,
            config, args, kwargs), "trainer_config": f(original, hf_config, args, kwargs), "trainer": f(trainer,
            *args, **kwargs)}``.
    """
    HANDLERS.update(handlers)


def _handler(name: str, where: str) -> "Callable[..., Any]":
    """The handler of gate ``name``: the provider is imported now when it has not filled the table yet; refused when
    the switch is off and the program did not import the provider."""
    if name not in HANDLERS:
        if not auto_enabled():
            _refuse_off(where)
        import importlib

        importlib.import_module(PROVIDER)  # it calls serve() when imported
    return HANDLERS[name]


def _wrap(owner: "Any", name: str, make: "Callable[[Callable], Callable]") -> None:
    """``owner.name = make(owner.name)``, once (the wrapper is marked), ``functools.wraps``-style."""
    import functools

    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    gate = functools.wraps(original)(make(original))
    setattr(gate, _MARK, True)
    setattr(owner, name, gate)


# ---- the gates ------------------------------------------------------------------------------------------------------

def _deepspeed_config_of_call(original: "Callable", args: tuple, kwargs: dict) -> "tuple[Optional[dict], Any]":
    """``(the call's arguments by name, its config)``; ``(None, None)`` when they do not bind to DeepSpeed's
    parameters (DeepSpeed raises its own TypeError)."""
    import inspect

    try:
        call = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError:
        return None, None
    source = call.get("config") if call.get("config") is not None else call.get("config_params")
    if source is None:
        source = getattr(call.get("args"), "deepspeed_config", None)
    return call, source


def _gate_deepspeed(deepspeed: "Any") -> None:
    def make(original: "Callable") -> "Callable":
        def initialize(*args: "Any", **kwargs: "Any") -> "Any":
            call, source = _deepspeed_config_of_call(original, args, kwargs)
            if call is None or not sets_key(source):
                return original(*args, **kwargs)
            return _handler("deepspeed.initialize", "deepspeed.initialize")(original, call)
        return initialize

    _wrap(deepspeed, "initialize", make)


def _gate_hf_deepspeed_config(module: "Any") -> None:
    def make(original: "Callable") -> "Callable":
        def trainer_config_process(self: "Any", *args: "Any", **kwargs: "Any") -> "Any":
            if not sets_key(getattr(self, "config", None)):
                return original(self, *args, **kwargs)
            return _handler("trainer_config", "TrainingArguments")(original, self, args, kwargs)
        return trainer_config_process

    _wrap(module.HfTrainerDeepSpeedConfig, "trainer_config_process", make)


def trainer_ds_config(trainer: "Any") -> "Any":
    """The DeepSpeed config of an HF Trainer being created (None without DeepSpeed): ``args.deepspeed``'s, or that
    of accelerate's DeepSpeed plugin (``accelerate launch`` with a ``deepspeed_config_file``)."""
    args = getattr(trainer, "args", None)
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if config is None:
        config = getattr(getattr(args, "deepspeed_plugin", None), "deepspeed_config", None)
    return config


def _gate_trainer(module: "Any") -> None:
    def make(original: "Callable") -> "Callable":
        def create_accelerator_and_postprocess(self: "Any", *args: "Any", **kwargs: "Any") -> "Any":
            if getattr(type(self), "_ds_usp_trainer", False) or not sets_key(trainer_ds_config(self)):
                return original(self, *args, **kwargs)
            return _handler("trainer", f"{type(self).__name__} (an HF Trainer)")(self, *args, **kwargs)
        return create_accelerator_and_postprocess

    _wrap(module.Trainer, "create_accelerator_and_postprocess", make)


def _gate_deepspeed_config(module: "Any") -> None:
    def make(original: "Callable") -> "Callable":
        def __init__(self: "Any", config: "Any", *args: "Any", **kwargs: "Any") -> "Any":
            if not sets_key(config):
                return original(self, config, *args, **kwargs)
            return _handler("deepspeed_config", "DeepSpeed's config")(original, self, config, args, kwargs)
        return __init__

    _wrap(module.DeepSpeedConfig, "__init__", make)


GATES = {"deepspeed": _gate_deepspeed, "deepspeed.runtime.config": _gate_deepspeed_config,
         "transformers.integrations.deepspeed": _gate_hf_deepspeed_config, "transformers.trainer": _gate_trainer}


def install() -> None:
    """Install the finder and the four gates (idempotent); the ``.pth`` calls it at interpreter start, ``import
    ds_usp`` too. A watched module already imported gets its gate now."""
    for name, gate in GATES.items():
        when_imported(name, gate)
