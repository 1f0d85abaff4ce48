"""The runtime questions about arrays: namespace, device, host values, tracing.

The single place that imports :mod:`array_api_compat`. Everything else asks this
module for the namespace, the device, the device kind and the library of an array,
whether its values can be read on the host now (no sync, no trace), how to copy
it there, and how to cut it out of autodiff. What a *library* can do (a native
kernel, a traced loop, threads...) is not asked here: it is a row of the router's
table, :data:`portable_attn._lib._route.LIBRARIES`.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import array_api_compat
import numpy as np
from array_api_compat import device as _compat_device
from array_api_compat import is_array_api_obj, size

__all__ = [
    "array_namespace",
    "branch_on_finite",
    "as_jax",
    "chunk_library",
    "chunk_sizes",
    "concrete_float",
    "default_integer_dtype",
    "device",
    "device_kind",
    "has_concrete_values",
    "has_cond_in_shard_map",
    "ids_in_one_dtype",
    "is_array_api_obj",
    "is_compiling",
    "is_traced",
    "jax_placeable",
    "library_name",
    "matmul_float32",
    "namespace_or_numpy",
    "numpy_namespace",
    "on_device",
    "reads_host_values",
    "register_pytree",
    "result_type",
    "size",
    "standard_namespace",
    "stop_gradient",
    "to_host",
    "records_grad",
    "forward_mode",
    "forward_over_reverse",
    "torch_func_transforms",
    "torch_records",
    "torch_release",
]

_NAMESPACE_BY_TYPE: dict[type, Any] = {}
_LIBRARY_BY_TYPE: dict[type, str] = {}


#: Array types whose ``.device`` attribute is what ``array_api_compat.device`` returns:
#: read directly, since the per-call checks ask for every argument's device (torch).
_DEVICE_ATTRIBUTE: set[type] = set()
_NDARRAY = np.ndarray


def device(x: Any) -> Any:
    """Return the device of `x` (``array_api_compat.device``; torch: ``.device`` directly)."""
    if type(x) in _DEVICE_ATTRIBUTE:
        return x.device
    if type(x) is _NDARRAY:  # NumPy: always the host
        return "cpu"
    if library_name(x) == "torch":
        import torch

        if type(x) is torch.Tensor:  # not a subclass, whose device may be wrapped
            _DEVICE_ATTRIBUTE.add(torch.Tensor)
    return _compat_device(x)


def library_name(x: Any) -> str:
    """Return the name of the library that owns array `x` (``"numpy"``, ``"torch"``, ...)."""
    cls = type(x)
    name = _LIBRARY_BY_TYPE.get(cls)
    if name is None:
        name = cls.__module__.split(".", 1)[0]
        name = "jax" if name == "jaxlib" else name  # concrete JAX arrays live in jaxlib
        _LIBRARY_BY_TYPE[cls] = name
    return name


def chunk_sizes(x: Any, axis: int) -> tuple[int, ...] | None:
    """Return the chunk sizes along `axis` of a Dask array split there, else None.

    Only for arrays split into several chunks along `axis` (with known sizes);
    NumPy, torch, JAX, CuPy and single-chunk axes give None.
    """
    if library_name(x) != "dask":
        return None
    sizes = x.chunks[axis]
    if len(sizes) < 2 or any(n != n for n in sizes):  # one chunk, or unknown (NaN) sizes
        return None
    return tuple(int(n) for n in sizes)


def chunk_library(x: Any) -> str:
    """Return the library of the chunks of a Dask array (``"numpy"``, ``"cupy"``), else of `x`."""
    if library_name(x) == "dask":
        x = getattr(x, "_meta", None)
    return library_name(x)


def split_rows(x: Any, cuts: list[int], axis: int = 0) -> list[Any]:
    """Return the consecutive parts ``x[cuts[i] : cuts[i+1]]`` along `axis` (0 or -2).

    torch: one ``torch.split``, whose backward is one concatenation; a slice's backward
    is a zero array of the whole of `x` each (the paged engine lane's backward at 8
    prefill requests: ``backward`` of benchmarks/results/serving-backward.json; a
    recorded tiled backward's blocks). Others: slices.
    """
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    if sizes and library_name(x) == "torch":
        import torch

        return list(torch.split(x, sizes, dim=axis))
    if axis == 0:
        return [x[a:b, ...] for a, b in itertools.pairwise(cuts)]
    return [x[..., a:b, :] for a, b in itertools.pairwise(cuts)]


def on_device(dev: Any) -> dict[str, Any]:
    """Keyword arguments that create an array on `dev`: ``{"device": dev}``, or ``{}``.

    Every function that creates an array next to its inputs goes through this:
    inside ``jax.jit`` a JAX tracer's device is None, and then the library must
    choose (JAX places the new array with the traced computation).
    """
    return {} if dev is None else {"device": dev}


def is_traced(x: Any) -> bool:
    """Whether `x` is an abstract value being traced (a JAX tracer under ``jax.jit``)."""
    if library_name(x) != "jax":
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def jax_placeable(x: Any) -> bool:
    """Whether JAX can take `x` as it is: a JAX array, or a NumPy array on the host."""
    return library_name(x) in ("jax", "numpy")


def as_jax(x: Any) -> Any:
    """`x` (:func:`jax_placeable`) as a JAX array; None stays None."""
    if x is None or library_name(x) == "jax":
        return x
    import jax.numpy as jnp

    return jnp.asarray(x)


def is_compiling(x: Any) -> bool:
    """Whether ``torch.compile`` is tracing the call that holds torch tensor `x`."""
    if library_name(x) != "torch":
        return False
    import torch

    return bool(torch.compiler.is_compiling())


def records_grad(*arrays: Any, functions: bool = False) -> bool:
    """Whether autograd may record a call of `arrays` (torch tensors that require grad).

    `functions`: the call holds the caller's functions, whose captured tensors no one
    can see: then wherever torch's grad mode is on. JAX differentiates by tracing, so
    its arrays never say so: False.
    """
    torch_arrays = [x for x in arrays if library_name(x) == "torch"]
    if not torch_arrays:
        return False
    if functions:
        import torch

        if torch.is_grad_enabled():
            return True
    return any(x.requires_grad for x in torch_arrays)


def torch_func_transforms(x: Any) -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ...) records tensor `x`."""
    if library_name(x) != "torch":
        return False
    import torch

    functorch = torch._C._functorch
    return bool(
        functorch.is_functorch_wrapped_tensor(x) or functorch.peek_interpreter_stack() is not None
    )


def forward_mode(arrays: Iterable[Any]) -> bool:
    """Whether automatic differentiation in forward mode records a call of `arrays`.

    torch: inside ``torch.autograd.forward_ad.dual_level()`` (dual tensors), or under
    ``torch.func.jvp`` (``jacfwd``, ``hessian``: a JVP transform on functorch's stack),
    not while ``torch.compile`` traces. JAX: one of `arrays` is traced by ``jax.jvp``
    (``jacfwd``, ``hessian``'s outer transform): a JVP tracer whose tangent is not
    ``grad``'s partial evaluation (jax < 0.5 differentiates in reverse that way too), or
    by ``jax.linearize``: a ``LinearizeTracer`` whose trace is not a VJP's (``grad`` and
    ``vjp`` linearize too, then transpose; a custom VJP has no linear map to evaluate).
    False for the other libraries, which do not differentiate. None entries are skipped.
    """
    given = [x for x in arrays if x is not None]
    lib = library_name(given[0]) if given else None
    if lib == "jax":
        jvp, partial, linear = _jax_tracers()
        return any(
            (isinstance(x, jvp) and not isinstance(getattr(x, "tangent", None), partial))
            or (isinstance(x, linear) and not getattr(getattr(x, "_trace", None), "is_vjp", True))
            for x in given
        )
    if lib != "torch":
        return False
    import torch

    forward_ad = sys.modules["torch.autograd.forward_ad"]
    # forward_ad's level is -1 outside a dual_level() (no public query of it)
    dual = getattr(forward_ad, "_current_level", -1) >= 0
    if not dual and torch._C._functorch.peek_interpreter_stack() is None:
        return False
    if torch.compiler.is_compiling():  # dynamo cannot trace functorch's queries
        return False
    if dual:
        return True
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def forward_over_reverse(arrays: Iterable[Any]) -> bool:
    """Whether torch differentiates a call of `arrays` in reverse inside forward mode.

    ``torch.func.jvp`` of ``torch.func.grad`` (or ``vjp``, ``jacrev``), as a
    Hessian-vector product runs: functorch's differentiating transforms are exactly a
    JVP with a reverse transform inside it (a higher level; ``vmap`` anywhere). Any other
    nesting (a gradient of that HVP) is not: the walk's own autodiff serves it. False
    for every other library (JAX's forward over reverse sees its reverse mode's tracers:
    not :func:`forward_mode`).
    """
    given = [x for x in arrays if x is not None]
    if not given or library_name(given[0]) != "torch":
        return False
    import torch

    if torch._C._functorch.peek_interpreter_stack() is None or torch.compiler.is_compiling():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    # torch.func's vjp and jacrev run as a Grad transform too
    kinds = (TransformType.Jvp, TransformType.Grad)
    stack = sorted((i.level(), i.key()) for i in retrieve_all_functorch_interpreters())
    return [key for _, key in stack if key in kinds] == list(kinds)


@functools.cache
def _jax_tracers() -> tuple[type, type, type | tuple[()]]:
    """Return JAX's tracers of ``jvp``, ``grad``'s partial evaluation and ``linearize``.

    The second is jax < 0.5's reverse mode; the third is an empty tuple before jax 0.5.
    """
    from jax._src.interpreters import ad as internal
    from jax.interpreters import ad, partial_eval

    return ad.JVPTracer, partial_eval.JaxprTracer, getattr(internal, "LinearizeTracer", ())


def torch_records(x: Any) -> bool:
    """Whether `x` is a torch tensor whose computation a torch tracer records (see below).

    ``torch.compile``, ``torch.jit.trace``, ``make_fx``, ``torch.export`` and the
    ``torch.func`` transforms; False for every other library.
    """
    return library_name(x) == "torch" and _torch_traces(x)


def has_concrete_values(x: Any) -> bool:
    """Whether the values of `x` can be read without tracing or computing a graph.

    False for JAX tracers, for lazy Dask arrays (reading would compute them), and for
    torch tensors while any torch tracer records (:func:`_torch_traces`): a value
    read there would be fixed into the graph, or refused.
    """
    lib = library_name(x)
    if lib == "torch":
        return not _torch_traces(x)
    return lib != "dask" and not is_traced(x)


def _torch_traces(x: Any) -> bool:
    """Whether a torch tracer records the computation on tensor `x`.

    ``torch.compile`` (dynamo), ``torch.jit.trace``, ``make_fx`` and ``torch.export``
    (a proxy or fake-tensor mode: any tensor dispatch mode counts), and the
    ``torch.func`` transforms (a wrapped tensor, or a transform active around an
    unwrapped one: a block mask first used inside ``torch.func.grad``).
    """
    import torch

    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    functorch = torch._C._functorch
    if functorch.is_functorch_wrapped_tensor(x) or functorch.peek_interpreter_stack() is not None:
        return True
    return bool(torch._C._len_torch_dispatch_stack())


def concrete_float(x: Any) -> float:
    """Read the value of a concrete 0-d array as a float (torch: of its detached value)."""
    if library_name(x) == "torch":
        return float(x.detach())
    return float(x)


def stop_gradient(x: Any) -> Any:
    """Return `x` cut out of automatic differentiation: its gradient is taken as zero.

    ``x.detach()`` for torch (eager, ``torch.compile`` and ``torch.func``),
    ``jax.lax.stop_gradient`` for JAX (under ``jit``, ``grad``, ``vmap``); the
    array itself for the libraries without autodiff. Used for the softmax's row-max
    shift, whose exact gradient is zero: differentiating through the max only adds
    terms that cancel, and compiled backwards (``torch.compile``, XLA) have turned
    them into NaN.
    """
    lib = library_name(x)
    if lib == "torch":
        return x.detach()
    if lib == "jax":
        import jax

        return jax.lax.stop_gradient(x)
    return x


def register_pytree(cls: type, flatten: Any, unflatten: Any) -> None:
    """Make `cls` a JAX pytree: now if JAX is imported, else the moment it is.

    Never imports JAX itself: a block mask or cache made with NumPy or torch before
    ``import jax`` is a pytree all the same (``jax.jit(f)(q, block_mask)``).
    """

    def register() -> None:
        import jax

        jax.tree_util.register_pytree_node(cls, flatten, unflatten)

    if sys.modules.get("jax") is not None:
        register()
    else:
        _AFTER_JAX.append(register)
        if not any(isinstance(f, _JaxImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _JaxImportHook())


_AFTER_JAX: list[Any] = []


class _JaxImportHook:
    """A meta path finder that runs the waiting registrations once ``jax`` is imported.

    It finds ``jax`` as the standard path finder does and wraps the loading of the
    module it found; it stays until a loading of ``jax`` completes (a lookup alone,
    ``importlib.util.find_spec("jax")``, imports nothing).
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "jax":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            while _AFTER_JAX:
                _AFTER_JAX.pop(0)()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def to_host(x: Any) -> Any:
    """Copy a small array (block states, ids) to a NumPy array on the host.

    Reads values: only for arrays with concrete values (:func:`has_concrete_values`),
    once per object that holds them (a :class:`~portable_attn.BlockMask`).
    """
    import numpy as np

    lib = library_name(x)
    if lib == "numpy":
        return np.asarray(x)
    if lib == "torch":
        return x.detach().cpu().numpy()
    if lib == "cupy":
        return x.get()
    if lib == "dask":
        return np.asarray(x.compute())
    if lib == "array_api_strict":
        import array_api_strict

        x = array_api_strict.asarray(x, copy=True, device=array_api_strict.Device("CPU_DEVICE"))
        return np.from_dlpack(x)
    return np.asarray(x)


def reads_host_values(x: Any) -> bool:
    """Whether values of `x` are host memory to read for free: no device sync, no trace.

    NumPy arrays, and torch CPU tensors while no torch tracer records
    (:func:`has_concrete_values`). Decisions that depend on values (skipping blocks
    of packed sequences by their segment ids) are taken only for such arrays.
    """
    lib = library_name(x)
    if lib == "numpy":
        return True
    return lib == "torch" and x.device.type == "cpu" and has_concrete_values(x)


def has_cond_in_shard_map() -> bool:
    """Whether JAX's ``shard_map`` takes a ``lax.cond`` (JAX with ``jax.shard_map``)."""
    import jax

    return hasattr(jax, "shard_map")


def branch_on_finite(
    arrays: tuple[Any, ...], plain: Callable[[], Any], exact: Callable[[], Any]
) -> Any:
    """``plain()`` where it equals ``exact()``, else ``exact()``; None for another library.

    `plain` computes without zeroing what a row never sees; `exact` zeroes it first.
    They differ only where a hidden entry of the JAX `arrays` is not finite
    (``0 · NaN``), and then the plain result is not finite: a non-finite value of V
    meets every row of the product, with weight 0 or not (a caller's `plain` must
    show it so). So the program (one ``jax.lax.cond``: both
    branches traced, one run) computes ``plain()`` and takes ``exact()`` only where
    its result (the first array of a tuple: a log-sum-exp may be ``-inf``) holds a
    NaN or ``±inf``: a reduction over the output, not over the cache. Decode with
    ``kv_lengths`` (B=4, H=8, Lk=4096, D=64) under ``jax.jit`` on XLA CPU: a
    ``where`` over K or V took 15 ms and a sum over one 0.75 ms; the output is 1/4096
    of V.

    Derivatives need more: ``dQ = dS K`` meets a hidden non-finite row of K, which
    the forward never shows. Their rule (``jax.custom_jvp``) chooses by the arrays'
    own finite sums, ``isfinite(sum(x))`` in float32 (NaN and ``±inf`` reach the sum;
    a finite sum past float32's range takes ``exact()``, still exact; ``sum(x * 0)``
    took 8 ms and a ``max`` / ``min`` pair missed NaN there).

    None also for a JAX without the top-level ``jax.shard_map`` (before 0.7), whose
    experimental ``shard_map`` has no replication rule for ``cond``
    (:func:`portable_attn.jax_parallel.sequence_parallel_attention` failed there):
    the caller takes ``exact()``.
    """
    if library_name(arrays[0]) != "jax" or not has_cond_in_shard_map():
        return None
    import jax
    import jax.numpy as jnp

    def all_finite(xs: Any) -> Any:
        return jnp.all(jnp.stack([jnp.isfinite(jnp.sum(x, dtype=jnp.float32)) for x in xs]))

    def by_result() -> Any:
        out = plain()
        first = out[0] if isinstance(out, tuple) else out
        return jax.lax.cond(all_finite((first,)), lambda: out, exact)

    def by_arrays() -> Any:
        return jax.lax.cond(all_finite(arrays), plain, exact)

    forward, forward_args = _with_arguments(by_result)
    derived, derived_args = _with_arguments(by_arrays)

    @jax.custom_jvp
    def chosen(forward_args: tuple[Any, ...], derived_args: tuple[Any, ...]) -> Any:
        return forward(*forward_args)

    @chosen.defjvp
    def _(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
        return jax.jvp(derived, tuple(primals[1]), tuple(tangents[1]))

    return chosen(tuple(forward_args), tuple(derived_args))


def _with_arguments(thunk: Callable[[], Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`thunk` as a function of the arrays it closes over, and those arrays.

    Every closed-over array (Q, K, V, the lengths, a learned ``score_mod``'s table,
    traced or not) becomes an argument, so that a ``jax.custom_jvp`` rule receives
    their tangents, and no tracer of the program being traced is kept inside another
    (``jax.closure_convert`` keeps integer tracers in, which leaked under ``jax.grad``).
    """
    import jax

    closed, shape = jax.make_jaxpr(thunk, return_shape=True)()
    tree = jax.tree_util.tree_structure(shape)

    def run(*arrays: Any) -> Any:
        return jax.tree_util.tree_unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, arrays))

    return run, tuple(closed.consts)


def torch_release() -> tuple[int, int]:
    """Return (major, minor) of the installed torch, read once.

    Kept in a dict: ``torch.compile`` warns about a ``functools`` cache wrapper.
    """
    release = _RELEASES.get("torch")
    if release is None:
        import torch

        major, minor = torch.__version__.split(".")[:2]
        release = _RELEASES["torch"] = (int(major), int(minor))
    return release


_RELEASES: dict[str, tuple[int, int]] = {}


def device_kind(x: Any) -> str:
    """``"cpu"``, ``"cuda"`` / ``"gpu"``, ... : the kind of device `x` lives on.

    torch's ``device.type`` and JAX's ``platform``; a JAX tracer, which has no device,
    takes the platform of JAX's default backend (where ``jit`` places its program);
    ``"cpu"`` for host libraries (NumPy, array-api-strict, Dask's NumPy chunks) and
    anything without one.
    """
    dev = device(x)
    kind = getattr(dev, "type", None) or getattr(dev, "platform", None)
    if kind is None:
        name = library_name(x)
        if name == "cupy":
            return "cuda"
        if name == "jax":
            import jax

            return str(jax.default_backend())
    return kind if isinstance(kind, str) else "cpu"


def matmul_float32(x: Any) -> Any:
    """``matmul(a, b)`` in `x`'s half dtype with float32 accumulation, or None.

    JAX's ``preferred_element_type``: `a` and `b` (half, or float32 to be rounded to
    `x`'s dtype first) are multiplied in that half dtype and summed (and returned) in
    float32, without a float32 copy of either operand (FlashAttention's form). None for
    libraries that offer no such matmul in the standard's terms (their half ``@``
    returns half precision).

    Derivatives are taken in float32 (a ``jax.custom_jvp``): JAX's own rule rounds the
    cotangent of a half operand to half precision, which for ``P @ V`` rounded ``dP``
    and for ``Q Kᵀ`` ``dS`` (a bias gradient 0.257 off float64 on jax's own bias
    gradient test, where float32 derivatives are 0.031 off, as ``jax.nn``); here the
    tangents multiply the rounded operands in float32, so an operand given in float32
    (the probabilities) gets a float32 cotangent and a half one (Q, K, V) is rounded once.
    """
    if library_name(x) != "jax":
        return None
    import jax
    import jax.numpy as jnp

    half, f32 = x.dtype, jnp.float32

    @jax.custom_jvp
    def matmul(a: Any, b: Any) -> Any:
        return jnp.matmul(a.astype(half), b.astype(half), preferred_element_type=f32)

    @matmul.defjvp
    def _tangent(primals: Any, tangents: Any) -> Any:
        a, b = primals
        da, db = tangents
        wide_a, wide_b = (y.astype(half).astype(f32) for y in (a, b))  # the rounded operands
        tangent = jnp.matmul(da.astype(f32), wide_b) + jnp.matmul(wide_a, db.astype(f32))
        return matmul(a, b), tangent

    return matmul


def result_type(xp: Any, *dtypes: Any) -> Any:
    """Return ``xp.result_type(*dtypes)`` of dtypes alone, decided without an array operation.

    array-api-compat's torch namespace looks pairs up in its own promotion table,
    which has no float16 or bfloat16: for those it asks ``torch.result_type`` of two
    empty tensors, an operation returning a dtype that ``torch.compile`` cannot put in
    a graph (``fullgraph=True`` failed for half inputs). For torch the dtypes are
    promoted by ``torch.promote_types``, which the compiler evaluates while tracing;
    the promotion is the same. Other namespaces answer as they are. (The dtypes say
    which library they are of: no ``functools`` cache wrapper, of which dynamo warns.)
    """
    if all(type(dt).__module__ == "torch" for dt in dtypes):  # torch.dtype
        import torch

        return functools.reduce(torch.promote_types, dtypes)
    return xp.result_type(*dtypes)


def default_integer_dtype(xp: Any) -> Any:
    """Return the namespace's default integer dtype (int32 for JAX without ``jax_enable_x64``)."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is not None:
        return info().default_dtypes()["integral"]
    return xp.int64  # pragma: no cover - every supported namespace has the info object


def ids_in_one_dtype(
    xp: Any, a: Any, b: Any, *, names: tuple[str, str], common: Any = None
) -> tuple[Any, Any]:
    """Two integer arrays of ids in one dtype, equal there exactly where equal by value.

    Ids of one dtype come back as they are. Otherwise both are cast to `common`
    (the namespace's default integer dtype: int64, or int32 for JAX without
    ``jax_enable_x64``), which is exact for every dtype that fits in it. An
    unsigned dtype as wide as `common` (``uint64`` next to ``int64``) does not
    fit: its values past ``iinfo(common).max`` wrap to negative numbers, so
    ``2**64 - 1`` would match ``-1``. Such values equal no value of the other
    side (which fits in `common`), and no negative id of the other side equals
    an unsigned id: the wrapped values become ``-1`` and the other side's
    negative ids ``-2``, which keeps "equal" exact between the two sides (only
    they are compared with each other). Pairs where neither rule applies are
    refused with a ValueError naming both arguments and dtypes.

    Parameters
    ----------
    xp : namespace
    a, b : integer arrays
        The ids compared with each other (``q_segment_ids``, ``kv_segment_ids``).
    names : (str, str)
        The argument names of `a` and `b`, for the error message.
    common : dtype, optional
        The dtype to compare in; the default integer dtype of `xp` by default.
    """
    if a.dtype == b.dtype:
        return a, b
    common = default_integer_dtype(xp) if common is None else common
    info = xp.iinfo(common)

    def fits(x: Any) -> bool:
        x_info = xp.iinfo(x.dtype)
        return int(x_info.min) >= int(info.min) and int(x_info.max) <= int(info.max)

    def wraps(x: Any) -> bool:  # unsigned, as wide as `common`: a bijection onto it
        return xp.isdtype(x.dtype, "unsigned integer") and xp.iinfo(x.dtype).bits == info.bits

    a_fits, b_fits = fits(a), fits(b)
    if not (a_fits and b_fits) and not (a_fits and wraps(b)) and not (b_fits and wraps(a)):
        msg = (
            f"`{names[0]}` ({a.dtype}) and `{names[1]}` ({b.dtype}) cannot be compared "
            f"exactly in one integer dtype ({common}): pass both ids in one dtype"
        )
        raise ValueError(msg)
    a_cast, b_cast = xp.astype(a, common), xp.astype(b, common)
    if a_fits and b_fits:
        return a_cast, b_cast

    def apart(x: Any, sentinel: int) -> Any:  # negative ids: `sentinel`, matching nothing
        return xp.where(x < 0, sentinel, x)

    if a_fits:  # b is the wrapping unsigned side
        a_cast = apart(a_cast, -2) if xp.isdtype(a.dtype, "signed integer") else a_cast
        return a_cast, apart(b_cast, -1)
    b_cast = apart(b_cast, -2) if xp.isdtype(b.dtype, "signed integer") else b_cast
    return apart(a_cast, -1), b_cast


def namespace_or_numpy(xp: Any, *, caller: str = "", positional: Any = None) -> Any:
    """Return the namespace for a function that creates arrays: `xp`, or NumPy's.

    The convention: such functions take a keyword-only ``xp=`` (NumPy when
    omitted). `positional` is a namespace passed first and positionally, the
    older form of ``kv_cache_init`` and ``init_mha_params``: still accepted,
    with a DeprecationWarning.
    """
    if positional is not None:
        if xp is not None:
            msg = f"{caller}() got the namespace both positionally and as `xp=`"
            raise TypeError(msg)
        warnings.warn(
            f"{caller}(xp, ...) with the namespace first is deprecated: pass it as "
            f"{caller}(..., xp=xp)",
            DeprecationWarning,
            stacklevel=3,
        )
        xp = positional
    return numpy_namespace() if xp is None else standard_namespace(xp)


_STANDARD: dict[int, Any] = {}


def standard_namespace(xp: Any, name: str = "xp") -> Any:
    """Return the array-API namespace of `xp`: a library's own module or its compat namespace.

    ``numpy``, ``torch``, ``jax.numpy``, ``cupy``, ``array_api_strict``, ``dask.array``
    and their :mod:`array_api_compat` namespaces all give the namespace their arrays
    have; anything else is a TypeError naming `name`.
    """
    found = _STANDARD.get(id(xp))
    if found is not None:
        return found
    try:
        found = array_api_compat.array_namespace(xp.asarray(0))
    except Exception:
        kind = type(xp).__name__
        shown = repr(xp) if isinstance(xp, str) else f"a {kind}"
        msg = (
            f"`{name}` must be an array namespace -- numpy, torch, jax.numpy, cupy, "
            f"array_api_strict, dask.array or its array_api_compat namespace -- but got "
            f"{shown}; pass the module itself (xp=torch, not xp='torch')"
        )
        raise TypeError(msg) from None
    if isinstance(xp, types.ModuleType):  # modules live as long as the process
        _STANDARD[id(xp)] = found
    return found


def _namespace_of(name: str, x: Any) -> Any:
    cls = type(x)
    xp = _NAMESPACE_BY_TYPE.get(cls)
    if xp is None:
        if x is None:
            msg = f"`{name}` must be an array, but got None"
            raise TypeError(msg)
        if not is_array_api_obj(x):
            msg = f"`{name}` must be an array, but got an object of type {cls.__qualname__!r}"
            raise TypeError(msg)
        xp = array_api_compat.array_namespace(x)
        # JAX tracers and other transient types are not cached: their namespace
        # is resolved each time (cheap), while the concrete array types are.
        if library_name(x) in {"numpy", "torch", "cupy", "array_api_strict", "dask"}:
            _NAMESPACE_BY_TYPE[cls] = xp
    return xp


def array_namespace(**arrays: Any) -> Any:
    """Return the one array-API namespace shared by the named arrays.

    ``None`` values are ignored (optional arguments), except for the first one
    named: it is the call's main input (``query``, ``x``, ``weights``), and None
    there raises a :class:`TypeError` "`query` must be an array, but got None".
    Arrays from different libraries raise a :class:`TypeError` that names both
    arguments and both libraries.

    Parameters
    ----------
    **arrays
        The arrays keyed by argument name, e.g. ``query=q, key=k``; the first
        one is required.

    Returns
    -------
    namespace
        The array-API compatible namespace (from ``array_api_compat``).
    """
    found_name = found_lib = xp = None
    for i, (name, x) in enumerate(arrays.items()):
        if x is None and i > 0:
            continue
        x_xp = _namespace_of(name, x)
        if xp is None:
            xp, found_name, found_lib = x_xp, name, library_name(x)
        elif x_xp is not xp:
            msg = (
                f"`{found_name}` and `{name}` come from different array libraries: "
                f"`{found_name}` is a {found_lib} array, `{name}` is a "
                f"{library_name(x)} array; convert them to one library first"
            )
            raise TypeError(msg)
    if xp is None:  # pragma: no cover - callers always pass at least one array
        msg = "at least one array is required"
        raise TypeError(msg)
    return xp


def numpy_namespace() -> Any:
    """Return the array-API compatible NumPy namespace."""
    import array_api_compat.numpy as np_xp

    return np_xp
