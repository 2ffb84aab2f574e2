"""Tensor parallelism (Megatron-style) for the Llama / Qwen3 decoder: process-group helpers, the
shard / gather functions the model calls; the loaders that build one rank's shard of the weights are
in :mod:`xoffload.models.tp_load` (re-exported here).

Launch: ``torchrun --nproc-per-node N script.py`` where the script makes ``LLM(...,
tensor_parallel_size=N)``; every rank runs the same script and the same generate loop.

What is sharded (rank ``r`` of ``N``; contiguous blocks, so query head ``h`` of a rank still reads
its KV head ``h // group`` of the same rank):

- q / k / v projections column-parallel: ``Hq/N`` query heads and ``Hkv/N`` KV heads per rank;
  the o-projection row-parallel (its ``Hq/N * D`` input columns), followed by an all-reduce (sum);
- MLP gate / up column-parallel (``I/N`` rows each), down row-parallel + all-reduce;
- embedding vocab-parallel (rows ``[r*V/N, (r+1)*V/N)``: masked lookup, zeros outside the shard,
  all-reduce), LM head vocab-parallel (each rank its ``V/N`` logits, then an all-gather);
- replicated: the norms (incl. Qwen3's q/k norms), RoPE tables.

The rank's :class:`~xoffload.models.config.ModelConfig` is the *local* one (``num_heads/N``,
``num_kv_heads/N``, ``intermediate_size/N``; ``vocab_size`` stays the full vocabulary), so every
KV store sized from it (resident cache, pinned offload pool, ring, page cache) holds 1/N of the KV
heads. Tokens are identical on every rank: after the all-gather every rank holds the same full
logits bit for bit, and each request's generator is seeded the same on every rank, so every rank
samples the same token (no broadcast per token). A count not divisible by N raises ValueError.

Failures: the process group has a timeout (``$XOFFLOAD_TP_TIMEOUT_S``, default 300 s). A rank that
raises inside :meth:`TensorParallel.guard` (``LLM.generate`` runs inside it) records its error in
the group's store and leaves the group; the other ranks' pending collective then fails (at once
when the peer's connection closes, else at the timeout) and they raise
:class:`TensorParallelError` naming the rank that failed and its error. Under torchrun, the agent
also ends every rank when one exits with an error.
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.nn.functional as F

from .llama import LlamaModel
from .tp_load import (check_divisible, load_gguf_sharded, load_hf_sharded, load_sharded, local_config,  # noqa: F401
                      random_sharded, shard_layer, shard_model)

__all__ = ["TensorParallel", "TensorParallelError", "init_tensor_parallel", "check_divisible", "local_config",
           "shard_layer", "shard_model", "random_sharded", "load_hf_sharded", "load_gguf_sharded", "load_sharded",
           "tensor_parallel_model", "gpu_numa_node", "bind_numa_node", "parse_cpulist", "TIMEOUT_ENV"]

#: seconds a collective may wait before it fails (and with it every rank)
TIMEOUT_ENV = "XOFFLOAD_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
#: set to 0 to keep the process's CPU affinity (no NUMA binding of the rank's pinned pool)
NUMA_ENV = "XOFFLOAD_TP_NUMA"
_FAIL_KEY = "xoffload/tp_failure"


class TensorParallelError(RuntimeError):
    """A collective of the tensor-parallel group failed because a rank failed (message: which one
    and its error, when the group's store still answers)."""


class TensorParallel:
    """One rank's view of a tensor-parallel group.

    Args:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ranks in the group (``N``).
        device: the rank's device (``cuda:LOCAL_RANK`` or cpu).
        group: the ``torch.distributed`` process group (None: the default group; ignored when
            ``world_size == 1``).
    Raises:
        ValueError: rank outside ``[0, world_size)``.
    """

    def __init__(self, rank: int, world_size: int, device="cpu", group=None):
        if not (0 <= int(rank) < int(world_size)):
            raise ValueError(f"rank {rank} outside [0, {world_size}) (world_size {world_size})")
        self.rank, self.world_size = int(rank), int(world_size)
        self.device = torch.device(device)
        self.group = group
        self.numa_node = None  # the GPU's NUMA node when the process was bound to it
        self.numa_cpus = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: tokenizes the prompts and broadcasts them (every rank returns the outputs)."""
        return self.rank == 0

    def __repr__(self):
        return f"TensorParallel(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (any shape and dtype); returns ``x``. The result is
        the same bit for bit on every rank (ring / tree reductions reduce each element once)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise minimum of ``x`` over the ranks, in place; returns ``x`` (e.g. the free GPU
        memory a batched KV pool is sized from, so every rank sizes it alike)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return x

    def vocab_range(self, vocab_size: int) -> tuple:
        """``(lo, hi)``: the rows of the ``vocab_size`` vocabulary this rank holds."""
        s = vocab_size // self.world_size
        return self.rank * s, (self.rank + 1) * s

    def embed(self, ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: ``ids`` int64 (any shape, full-vocabulary ids) looked up in this
        rank's rows ``shard`` ``[V/N, hidden]`` (zeros for ids outside them), summed over the ranks:
        ``[*ids.shape, hidden]`` in the shard's dtype, equal to the unsharded lookup exactly. No
        host read (CUDA-graph safe)."""
        vs = shard.shape[0]
        lo = self.rank * vs
        inside = (ids >= lo) & (ids < lo + vs)
        e = F.embedding((ids - lo) * inside, shard)
        e.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.all_reduce(e)

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel LM head output: this rank's logits ``x`` ``[n, V/N]`` -> the full ``[n, V]``
        (rank r's columns at ``[r*V/N, (r+1)*V/N)``), the same on every rank."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        n, vs = x.shape
        out = torch.empty(self.world_size * n, vs, dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, n, vs).permute(1, 0, 2).reshape(n, self.world_size * vs)

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of rank ``src`` (picklable) on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (a no-op for one rank)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ failures
    def _store(self):
        try:
            import torch.distributed as dist

            return dist.distributed_c10d._get_default_store()
        except Exception:
            return None

    def _failure_elsewhere(self) -> str | None:
        st = self._store()
        if st is None:
            return None
        try:
            if st.check([_FAIL_KEY]):
                return st.get(_FAIL_KEY).decode("utf-8", "replace")
        except Exception:
            return None
        return None

    @contextlib.contextmanager
    def guard(self):
        """Run a block that contains collectives. An exception raised on this rank is recorded in
        the group's store (``"rank R raised T: msg"``) and this rank leaves the group so peers
        blocked in a collective fail at once; an exception from a collective failing because
        another rank failed becomes :class:`TensorParallelError` naming that rank and its error.
        ValueError / TypeError pass through untouched (input checks, e.g. a prompt the batched
        pool can never hold, are made alike on every rank before any collective of the request)."""
        if self.world_size == 1:
            yield
            return
        try:
            yield
        except Exception as e:
            other = self._failure_elsewhere()
            if other is not None and not other.startswith(f"rank {self.rank} "):
                self._leave()
                raise TensorParallelError(f"tensor-parallel rank {self.rank} stopped: {other} "
                                          f"(here: {type(e).__name__}: {str(e)[:200]})") from e
            if isinstance(e, (ValueError, TypeError)) and not _is_collective_error(e):
                raise  # a check of the inputs, made alike on every rank (the LLM keeps serving)
            if _is_collective_error(e):
                self._leave()
                raise TensorParallelError(f"tensor-parallel rank {self.rank}: a collective failed "
                                          f"({type(e).__name__}: {str(e)[:300]}); another rank probably "
                                          f"failed first (see its error)") from e
            st = self._store()
            try:
                if st is not None:
                    st.set(_FAIL_KEY, f"rank {self.rank} raised {type(e).__name__}: {str(e)[:500]}")
            except Exception:
                pass
            self._leave()
            raise

    def _leave(self):
        """Leave the group after a failure (peers' collectives then fail instead of waiting)."""
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _is_collective_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    msg = str(e)
    return any(s in msg for s in ("Connection closed by peer", "Connection reset", "Timed out", "timed out",
                                  "gloo", "NCCL", "ProcessGroup"))


def _timeout_s() -> float:
    v = os.environ.get(TIMEOUT_ENV)
    if v is None:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds, got {v!r}") from None
    if not t > 0:
        raise ValueError(f"${TIMEOUT_ENV} must be > 0 seconds, got {v!r}")
    return t


def init_tensor_parallel(size: int, device=None) -> TensorParallel:
    """This rank's :class:`TensorParallel` for a group of ``size`` ranks, the process group
    initialised from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless ``torch.distributed`` is initialised already.

    Backend: NCCL on CUDA (``NCCL_NVLS_ENABLE=0`` set if unset: NVLink multicast stays off; the
    rank's device is ``cuda:LOCAL_RANK``), gloo on the CPU. Collectives time out after
    ``$XOFFLOAD_TP_TIMEOUT_S`` seconds (default 300).

    Args:
        size: ``tensor_parallel_size`` (>= 1; 1 returns a group of one without torch.distributed).
        device: None (CUDA if available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:LOCAL_RANK"``.
    Raises:
        ValueError: ``size > 1`` but ``WORLD_SIZE`` is missing or differs (not launched with
            ``torchrun --nproc-per-node size``), a device index other than ``LOCAL_RANK``, a bad
            timeout.
    """
    import torch.distributed as dist

    size = int(size)
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if size == 1:
        return TensorParallel(0, 1, dev)
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        ws = os.environ.get("WORLD_SIZE")
        if ws is None or "RANK" not in os.environ:
            raise ValueError(f"tensor_parallel_size={size} needs one process per rank: launch with "
                             f"`torchrun --nproc-per-node {size} your_script.py` (WORLD_SIZE/RANK not set)")
        world, rank = int(ws), int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} but WORLD_SIZE={world}: launch with "
                         f"`torchrun --nproc-per-node {size}`")
    if dev.type == "cuda":
        if dev.index is not None and dev.index != local:
            raise ValueError(f"device {dev} differs from this rank's LOCAL_RANK {local} (pass device='cuda')")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_timeout_s()), **kw)
        _register_exit()
    return TensorParallel(rank, world, dev)


_EXIT_REGISTERED = False


def _register_exit():
    global _EXIT_REGISTERED
    if _EXIT_REGISTERED:
        return
    import atexit

    def _bye():
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass

    atexit.register(_bye)
    _EXIT_REGISTERED = True


# ---------------------------------------------------------------------------- NUMA
def parse_cpulist(text: str) -> list:
    """CPU ids of a sysfs cpulist (``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``); ValueError
    naming a malformed part."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        try:
            if "-" in part:
                a, b = part.split("-")
                cpus.extend(range(int(a), int(b) + 1))
            else:
                cpus.append(int(part))
        except ValueError:
            raise ValueError(f"malformed cpulist part {part!r} in {text!r}") from None
    return cpus


def gpu_numa_node(device, sysfs: str = "/sys") -> int | None:
    """The NUMA node of CUDA ``device`` from ``/sys/bus/pci/devices/<bus id>/numa_node``; None off
    CUDA, when the machine shows none (-1) or sysfs has no such file."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    dom, bus, dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is None or dev is None:
        return None
    path = os.path.join(sysfs, "bus", "pci", "devices", f"{dom or 0:04x}:{bus:02x}:{dev:02x}.0", "numa_node")
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def bind_numa_node(node: int | None, sysfs: str = "/sys") -> list | None:
    """Restrict this process to the CPUs of NUMA ``node`` (those it may already use), so the pinned
    pool allocated afterwards is first touched, hence placed, on that node. Returns the CPUs, or
    None (no node, no such sysfs file, no overlap: nothing changed)."""
    if node is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        with open(os.path.join(sysfs, "devices", "system", "node", f"node{int(node)}", "cpulist")) as f:
            cpus = parse_cpulist(f.read())
    except (OSError, ValueError):
        return None
    cpus = sorted(set(cpus) & os.sched_getaffinity(0))
    if not cpus:
        return None
    os.sched_setaffinity(0, cpus)
    return cpus


# ---------------------------------------------------------------------------- LLM's hook
def tensor_parallel_model(model, config) -> LlamaModel:
    """What ``LLM(model, tensor_parallel_size=N, ...)`` runs on each rank: join the group
    (:func:`init_tensor_parallel`), bind the process to its GPU's NUMA node (unless
    ``$XOFFLOAD_TP_NUMA=0``; before the pinned pool exists) and load this rank's shard
    (:func:`load_sharded`). ``config``: the LLM's :class:`~xoffload.engine.config.EngineConfig`
    (``tensor_parallel_size``, ``dtype``, ``device``, ``seed``)."""
    tp = init_tensor_parallel(config.tensor_parallel_size, config.device)
    if tp.device.type == "cuda" and os.environ.get(NUMA_ENV, "1") != "0":
        tp.numa_node = gpu_numa_node(tp.device)
        tp.numa_cpus = bind_numa_node(tp.numa_node)
    with tp.guard():
        m = load_sharded(model, tp, dtype=config.dtype, seed=config.seed)
        tp.barrier()
    return m
