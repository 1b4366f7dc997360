"""Taps on a Flax NNX model's layers: each tapped layer records its input A and adds a zero
perturbation to its output, whose gradient is B = dloss/dy (book-keeping clipping,
`dp.bookkeeping`).

A **rule** says, for one layer class, how its kernel's gradient follows from A and B: the layer
computes y = A W (A: its input as token rows, (T, d); W: its kernel as a (d, p) matrix), so one
example's kernel gradient is A^T B, and `grads` maps that (d, p) matrix to the gradients of the
parameters the rule covers (the kernel reshaped; for a weight-standardized kernel, the chain rule
through the standardization, which gives its gain's gradient too). The layer's own forward runs
unchanged: the tap wraps it (y + 0), so a tapped model computes exactly what the model computes.
Parameters no rule covers (biases, norm scales and offsets, class tokens, position embeddings)
get their per-example gradients from per-example offsets instead (`dp.bookkeeping`).

Flax NNX has no method interception (Linen's `intercept_methods`), so `tap_model` switches the
class of each known layer of a freshly merged model (a copy made inside the traced function; the
caller's model is never touched) to a subclass whose `__call__` calls the original and then the
active `Taps`. Hand-written because no JAX library taps NNX layers (jax-privacy 2.0 vmaps).
Rules for `nnx.Linear` live here, for `nnx.Conv` in `dp.flax_rules`; `finetune.models`
registers its convolutions and patch embed.

A layer class with trained parameters and no rule is still clipped exactly: its parameters get
per-example gradients from offsets (`dp.bookkeeping`), formed at their full size per example.
Layers whose parameters are meant for that route (norm scales and offsets, embeddings, a
ViT's class token) are declared with `register_offset_layer`; any other class is named in a
one-line notice (`unknown_layers`), so a user's own layer is never clipped slower silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Rule", "Taps", "register_offset_layer", "register_rule", "rule_for", "tap_model",
           "notify_uncovered", "unknown_layers"]


class Rule(NamedTuple):
    """How a layer class's kernel gradient follows from its input and output gradient.

    inputs(module, x) -> A, (..., d): the rows that multiply the kernel (x itself for a dense
      layer; im2col patches for a convolution); leading axes are flattened into tokens.
    params: the names of the parameters the rule covers (the first is the kernel).
    grads(module, g) -> {name: gradient}: one example's gradients from g = A^T B, (d, p).
      None: the kernel's gradient is g reshaped to the kernel (a plain matmul layer), which
      also lets the clipper use ghost norms (it never forms g).
    row_grads(module, a, b) -> {name: (n, ...) gradients}: every example's gradients from its
      rows a (n, T, d) and b (n, T, p) directly, for a layer whose gradients are much smaller
      than A^T B (low-rank adapters, `finetune.modes`); it takes precedence over `grads`.
    ghost: a ghost norm through `grads`' map, for a layer whose gradients are a fixed linear
      map of A^T B (weight standardization, `finetune.models.ws_ghost`): an object with
      `prefer(n, T, d, p)` (the cost choice), `norm(module, a, b) -> (bound (n,), data)`,
      `sums(module, data, factor, keep, acc) -> {name: clipped sum}` (reduced over the batch
      in dtype acc) and `slack(n, data)` (its reduction's bound relative to C,
      `dp.bookkeeping.reduction_slack`); None: `grads` only.
    example_grads(module, x, b) -> (n, d, p) or None: every example's A^T B from the input x
      (n, ...) as the layer received it and b (n, T, p), where the rule has a faster way than
      forming A (None: form A); the tap then records x, and A = inputs(module, x) is formed
      only where it is used.
    input_grads(module, x, b) -> {name: (n, ...) gradients}: as row_grads, from the input x
      (n, ...) as the layer received it instead of its rows (a depthwise convolution's kernel
      taps: windows of x times b, never the k^2-wide patches); it takes precedence over
      row_grads, and the tap records x.
    """

    inputs: Callable[[Any, jax.Array], jax.Array]
    params: tuple[str, ...] = ("kernel",)
    grads: Callable[[Any, jax.Array], dict[str, jax.Array]] | None = None
    row_grads: Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]] | None = None
    ghost: Any = None
    example_grads: Callable[[Any, jax.Array, jax.Array], jax.Array | None] | None = None
    input_grads: Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]] | None = None

    @property
    def takes_input(self) -> bool:
        """Whether the tap records the layer's input x as it came (not its rows A)."""
        return self.example_grads is not None or self.input_grads is not None


_RULES: dict[type, Rule | Callable[[Any], Rule | None]] = {}
_OFFSET_LAYERS: set[type] = set()
_TAPPED: dict[type, type] = {}
_ACTIVE: list[Taps] = []


def register_rule(cls: type, rule: Rule | Callable[[Any], Rule | None]) -> None:
    """Declare how to tap layers of class `cls` (exactly this class, not its subclasses: a
    subclass may compute something else): a `Rule`, or a function of the layer that gives its
    rule, or None for an instance whose options no rule implements (a dilated `nnx.Conv`)."""
    _RULES[cls] = rule


def rule_for(module: Any) -> Rule | None:
    """The rule of `module` (its class's, or what its class's function gives), or None."""
    cls = type(module)
    rule = _RULES.get(cls.__dict__.get("_dp_base", cls))
    return rule if rule is None or isinstance(rule, Rule) else rule(module)


def register_offset_layer(cls: type) -> None:
    """Declare that layers of class `cls` (exactly) hold only parameters meant to be clipped
    through per-example offsets (module docstring): no notice names them."""
    _OFFSET_LAYERS.add(cls)


def unknown_layers(model: nnx.Module, trained: set[tuple]) -> dict[tuple, str]:
    """The layers whose parameters no rule and no declaration covers (module docstring).

    Args:
      model: the NNX model.
      trained: the flat paths of its trained parameters.

    Returns:
      Module path -> its class's qualified name, for every layer that holds a trained
      parameter of its own and has neither a rule (a rule's layer trains its bias through
      offsets by design) nor an offset-layer declaration (`register_offset_layer`).
    """
    found = {}
    for path, module in nnx.iter_modules(model):
        path = tuple(path)
        own = any(len(p) == len(path) + 1 and p[:-1] == path for p in trained)
        if own and rule_for(module) is None and type(module) not in _OFFSET_LAYERS:
            found[path] = f"{type(module).__module__}.{type(module).__qualname__}"
    return found


def notify_uncovered(notices: Callable[[str], None] | None, model: nnx.Module,
                     sizes: dict[tuple, int], covered: set[tuple]) -> None:
    """Tell `notices` (once per compile; None: nobody) which layers no rule knows, in one line
    (`unknown_layers`), and in another the other large parameters no rule covers.

    Args:
      notices: called with each line.
      model: the NNX model.
      sizes: flat path -> entries, of every trained parameter.
      covered: the flat paths the tapped layers' rules cover.
    """
    if notices is None:
        return
    unknown = unknown_layers(model, set(sizes))
    if unknown:
        notices("book-keeping clipping has no rule for the layers "
                + ", ".join(f"{'.'.join(map(str, p)) or '(the model)'} ({c})"
                            for p, c in unknown.items())
                + ": their parameters' per-example gradients are formed (exact clipping, "
                "slower; `dp.taps.register_rule` declares a faster rule)")
    big = [".".join(map(str, p)) for p, size in sizes.items()
           if p not in covered and p[:-1] not in unknown and size > 65536]
    if big:
        notices("book-keeping clipping has no rule for " + ", ".join(big)
                + ": their per-example gradients are formed (exact, slower)")


register_rule(nnx.Linear, Rule(inputs=lambda m, x: x))
for _cls in (nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.Embed, nnx.BatchNorm):
    register_offset_layer(_cls)  # scales, offsets, embedding rows: small or sparse per example


class Taps:
    """The state of one traced forward pass: which layers are tapped (module path -> name),
    their perturbations (None while discovering shapes), and what they recorded."""

    def __init__(self, names: dict[tuple, str], perturbations: dict[str, jax.Array] | None):
        self.names = names
        self.perturbations = perturbations
        self.inputs: dict[str, jax.Array] = {}
        self.output_shapes: dict[str, jax.ShapeDtypeStruct] = {}

    def __enter__(self) -> Taps:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop()

    def record(self, name: str, module: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        """Record the layer's input rows; return y plus its (zero) perturbation."""
        if name in self.inputs:  # a second call would pair its B with the other call's A
            raise ValueError(f"book-keeping clipping taps each layer once per forward pass, but "
                             f"{name} is called more than once; use "
                             f"FinetuneFlags(clipping='per_example') for this model")
        rule = rule_for(module)
        if rule.takes_input:  # A is formed later, where it is used (if at all)
            self.inputs[name] = x
        else:
            rows = rule.inputs(module, x)
            self.inputs[name] = rows.reshape(-1, rows.shape[-1])
        if self.perturbations is None:
            self.output_shapes[name] = jax.ShapeDtypeStruct(y.shape, y.dtype)
            return y
        return y + self.perturbations[name].astype(y.dtype)


def _tapped_call(self, x, *args, **kwargs):
    y = super(type(self), self).__call__(x, *args, **kwargs)
    taps = _ACTIVE[-1] if _ACTIVE else None
    name = self.__dict__.get("_dp_tap")
    if taps is None or name is None:
        return y
    return taps.record(name, self, x, y)


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED:
        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,),
                            {"__call__": _tapped_call, "_dp_base": cls})
    return _TAPPED[cls]


def tap_model(model: nnx.Module, names: dict[tuple, str]) -> nnx.Module:
    """Switch each layer of `model` whose path is in `names` to its tapped class (in place:
    call it on a model merged inside the traced function, never on the caller's)."""
    for path, module in nnx.iter_modules(model):
        name = names.get(tuple(path))
        if name is not None:
            object.__setattr__(module, "__class__", _tapped_class(type(module)))
            object.__setattr__(module, "_dp_tap", name)
    return model


def tappable_layers(model: nnx.Module, trained: set[tuple]) -> dict[tuple, str]:
    """Module path -> tap name for every layer with a rule one of whose parameters is in
    `trained` (flat parameter paths)."""
    names = {}
    for path, module in nnx.iter_modules(model):
        rule = rule_for(module)
        if rule is not None and any((*path, p) in trained for p in rule.params):
            names[tuple(path)] = "/".join(str(p) for p in path)
    return names


def promote_float32(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Arrays in at least float32 (A and B of a bfloat16 forward, for norms and sums)."""
    return tuple(a.astype(jnp.promote_types(a.dtype, jnp.float32)) for a in arrays)
