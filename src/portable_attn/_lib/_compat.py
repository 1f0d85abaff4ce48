"""The single place that imports :mod:`array_api_compat`, and what each library can do.

Everything else in the package asks this module for the namespace, the device
and the library name of an array, so backend detection lives in one spot and can
be cached per array type (namespace resolution is the largest part of the
per-call overhead on tiny inputs).

Policy elsewhere asks *capabilities* rather than comparing library names:
:func:`is_traced`, :func:`has_concrete_values`, :func:`has_native_kernel`,
:func:`traces_python_loops`, :func:`multithreaded_elementwise`. Each answers from
the array's library here, and only here.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import array_api_compat
from array_api_compat import device as _compat_device
from array_api_compat import is_array_api_obj, size

__all__ = [
    "array_namespace",
    "autodiff_family",
    "builds_task_graphs",
    "native_kernel_needs_equal_dims",
    "chunk_sizes",
    "default_integer_dtype",
    "device",
    "device_kind",
    "fused_native_kernel",
    "concrete_float",
    "has_concrete_values",
    "has_native_kernel",
    "ids_in_one_dtype",
    "is_array_api_obj",
    "is_traced",
    "library_name",
    "matmul_float32",
    "multithreaded_elementwise",
    "namespace_or_numpy",
    "numpy_namespace",
    "on_device",
    "parallel_query_blocks",
    "pins_devices",
    "reads_host_values",
    "size",
    "stop_gradient",
    "traces_python_loops",
]

_NAMESPACE_BY_TYPE: dict[type, Any] = {}
_LIBRARY_BY_TYPE: dict[type, str] = {}


#: Array types whose ``.device`` attribute is what ``array_api_compat.device`` returns:
#: read directly, since the per-call checks ask for every argument's device (torch).
_DEVICE_ATTRIBUTE: set[type] = set()


def device(x: Any) -> Any:
    """Return the device of `x` (``array_api_compat.device``; torch: ``.device`` directly)."""
    if type(x) in _DEVICE_ATTRIBUTE:
        return x.device
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


def builds_task_graphs(x: Any) -> bool:
    """Whether `x` is a lazy task-graph array (Dask): the call becomes tasks on its chunks."""
    return library_name(x) == "dask"


def autodiff_family(x: Any) -> str | None:
    """``"torch"`` or ``"jax"``: whose custom-backward and native-kernel API `x` takes, or None."""
    lib = library_name(x)
    return lib if lib in ("torch", "jax") else None


def native_kernel_needs_equal_dims(x: Any) -> bool:
    """Whether the native kernel of `x`'s library needs ``Dv == Dk`` (``jax.nn``'s does)."""
    return library_name(x) == "jax"


def chunk_sizes(x: Any, axis: int) -> tuple[int, ...] | None:
    """Return the chunk sizes along `axis` of a Dask array split there, else None.

    Only for arrays split into several chunks along `axis` (with known sizes);
    NumPy, torch, JAX, CuPy and single-chunk axes give None.
    """
    if not builds_task_graphs(x):
        return None
    sizes = x.chunks[axis]
    if len(sizes) < 2 or any(n != n for n in sizes):  # one chunk, or unknown (NaN) sizes
        return None
    return tuple(int(n) for n in sizes)


def on_device(dev: Any) -> dict[str, Any]:
    """Keyword arguments that create an array on `dev`: ``{"device": dev}``, or ``{}``.

    Every function that creates an array next to its inputs goes through this:
    inside ``jax.jit`` a JAX tracer's device is None, and then the library must
    choose (JAX places the new array with the traced computation).
    """
    return {} if dev is None else {"device": dev}


def pins_devices(x: Any) -> bool:
    """Whether mixing devices among the arguments is an error to catch (torch, CuPy).

    JAX places (and shards) arrays itself: a device of a JAX array may be a
    sharding over several devices, which is not to be compared with another's.
    """
    return library_name(x) in ("torch", "cupy")


def is_traced(x: Any) -> bool:
    """Whether `x` is an abstract value being traced (a JAX tracer under ``jax.jit``)."""
    if library_name(x) != "jax":
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def has_concrete_values(x: Any) -> bool:
    """Whether the values of `x` can be read without tracing or computing a graph.

    False for JAX tracers, for lazy Dask arrays (reading would compute them), for
    torch tensors while ``torch.compile`` traces (reading would break the graph)
    and for the wrapped tensors of ``torch.func`` transforms (``vmap`` refuses
    ``.item()``).
    """
    lib = library_name(x)
    if lib == "torch":
        import torch

        if torch.compiler.is_compiling():
            return False
        return not torch._C._functorch.is_functorch_wrapped_tensor(x)
    return lib != "dask" and not is_traced(x)


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


_PYTREES: set[type] = set()


def register_pytree_once(cls: type) -> None:
    """Register `cls` (``tree_flatten`` / ``tree_unflatten``) as a JAX pytree, once.

    Only once JAX is imported (this never imports JAX): a class instantiated before
    that is registered by its next instance.
    """
    if cls in _PYTREES or "jax" not in sys.modules:
        return
    import jax

    jax.tree_util.register_pytree_node_class(cls)
    _PYTREES.add(cls)


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

    NumPy arrays, and torch CPU tensors outside ``torch.compile`` and ``torch.func``
    transforms. Decisions that depend on values (skipping blocks of packed sequences
    by their segment ids) are taken only for such arrays.
    """
    lib = library_name(x)
    if lib == "numpy":
        return True
    return lib == "torch" and x.device.type == "cpu" and has_concrete_values(x)


def has_native_kernel(x: Any) -> bool:
    """Whether the library of `x` has a fused attention kernel (``_paths/_native.py``)."""
    return library_name(x) in ("torch", "jax")


def fused_native_kernel(x: Any) -> bool:
    """Whether the native kernel of `x`'s library is fused by default (torch SDPA).

    PyTorch's SDPA picks a fused flash / memory-efficient kernel on CPU and CUDA
    when given no mask; ``jax.nn.dot_product_attention`` with its default
    implementation composes XLA operations (cuDNN only on request, on GPUs).
    """
    return library_name(x) == "torch"


#: The torch release from which SDPA on the CPU returns zeros, with zero gradients, for
#: a query row that sees no key: every key masked by a boolean mask or ``-inf`` in an
#: additive one. Measured on torch 2.13.0 (float16, bfloat16, float32, float64; its
#: flash and math kernels; forward and backward; eager, under ``torch.compile`` with
#: inductor and under ``torch.func.vmap`` / ``grad``); ``tests/test_native.py`` and
#: ``tests/test_transforms.py`` check it on every run. Earlier releases are not
#: measured here, and CUDA's kernels not at all.
TORCH_CPU_ZEROES_EMPTY_ROWS = (2, 13)


def native_kernel_zeroes_empty_rows(x: Any) -> bool:
    """Whether the native kernel for `x` returns zeros (zero gradients) on rows without keys.

    Where it does, the native route adds no guard around it (``_paths/_native.py``):
    torch on the CPU from :data:`TORCH_CPU_ZEROES_EMPTY_ROWS`.
    """
    if library_name(x) != "torch" or x.device.type != "cpu":
        return False
    return _torch_release() >= TORCH_CPU_ZEROES_EMPTY_ROWS


def _torch_release() -> tuple[int, int]:
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

    torch's ``device.type`` and JAX's ``platform``; ``"cpu"`` for host libraries
    (NumPy, array-api-strict, Dask's NumPy chunks) and anything without one.
    """
    dev = device(x)
    kind = getattr(dev, "type", None) or getattr(dev, "platform", None)
    if kind is None and library_name(x) == "cupy":
        return "cuda"
    return kind if isinstance(kind, str) else "cpu"


def matmul_float32(x: Any) -> Any:
    """``matmul(a, b)`` of half-precision operands with float32 accumulation, or None.

    JAX's ``preferred_element_type``: the products of two bfloat16/float16 arrays
    are summed (and returned) in float32, without a float32 copy of either operand
    (FlashAttention's form). None for libraries that offer no such matmul in the
    standard's terms (their half ``@`` returns half precision).
    """
    if library_name(x) != "jax":
        return None
    import jax.numpy as jnp

    def matmul(a: Any, b: Any) -> Any:
        return jnp.matmul(a, b, preferred_element_type=jnp.float32)

    return matmul


def traces_python_loops(x: Any) -> bool:
    """Whether a Python loop over blocks becomes nodes of a traced program (JAX).

    Such libraries are usually called under ``jax.jit``: every block of the
    tiled path is a node of the compiled program, so the block count must stay
    bounded.
    """
    return library_name(x) == "jax"


def multithreaded_elementwise(x: Any) -> bool:
    """Whether eager elementwise operations of the library of `x` run on several threads.

    PyTorch's CPU kernels are multi-threaded; NumPy's ufuncs, array-api-strict
    and the per-chunk NumPy of Dask run on one thread.
    """
    return library_name(x) == "torch"


def parallel_query_blocks(x: Any) -> bool:
    """Whether query blocks may run in threads (NumPy; see ``portable_attn._paths._threads``).

    True for eager libraries whose elementwise ops run on one core and release
    the GIL, with no autodiff to record the threads' work.
    """
    return library_name(x) == "numpy"


def compiles_eager_calls(x: Any) -> bool:
    """Whether an eager call on `x` runs its path as one compiled program (concrete JAX).

    JAX dispatches every eager operation on its own (about 10-20 us each on a CPU), so
    an eager call compiles its path once per call signature and reuses it, as
    ``jax.nn.dot_product_attention`` (itself under ``jax.jit``) does; traced calls
    (under ``jit``, ``grad``, ``vmap``) are already one program.
    """
    return library_name(x) == "jax" and not is_traced(x)


def fuses_softmax_into_matmul(x: Any) -> bool:
    """Whether the library's compiler fuses a softmax into the matmul after it (XLA: JAX).

    Every JAX call runs compiled (under ``jit``, or as one program per eager call:
    :func:`compiles_eager_calls`); XLA CPU compiles the row max, ``exp``, the row sums,
    the division and ``P @ V`` into one kernel when nothing selects on the row
    statistics between them.
    """
    return library_name(x) == "jax"


def reuses_buffers(x: Any) -> bool:
    """Whether the tiled path runs its block loop in reused buffers (``out=``): NumPy.

    NumPy arrays, and Dask arrays of NumPy chunks (their pair tasks run NumPy). No
    autodiff records NumPy's in-place writes (``portable_attn._paths._buffered``).
    """
    if builds_task_graphs(x):
        x = getattr(x, "_meta", None)
    return library_name(x) == "numpy"


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
    return numpy_namespace() if xp is None else xp


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
