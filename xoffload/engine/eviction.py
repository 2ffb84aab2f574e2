"""Room in the pinned pool for a session's turn or a request: idle sessions of an engine
(:class:`~.llm_engine.LLMEngine`) give way, least recently used first, never one whose turn is
running; the prefix cache's blocks no live sequence holds count as free (the allocator evicts
them itself)."""
from __future__ import annotations

__all__ = ["reclaimable_blocks", "make_room"]


def reclaimable_blocks(engine, keep=None) -> int:
    """Pool blocks that evicting every idle session (not ``keep``, none in a turn) and the
    prefix cache could free: allocated blocks that no other live pool sequence holds."""
    eng = engine.offload
    if eng is None:
        return 0
    idle = {s.seq for s in engine.sessions.values() if s is not keep and not s.busy and s.seq is not None}
    protected = set()
    for sid in eng.sequences():
        if sid not in idle:
            protected.update(eng.block_table(sid))
    return eng.allocator.num_blocks - eng.num_free_blocks - len(protected)


def make_room(engine, blocks: int, keep=None) -> int:
    """Evict idle sessions, least recently used first, until the pinned pool has ``blocks``
    free blocks counting what the prefix cache can evict (or no idle session is left); never
    ``keep`` or a session in a turn. Returns the sessions' blocks released."""
    eng = engine.offload
    if eng is None:
        return 0
    freed = 0
    for s in sorted(engine.sessions.values(), key=lambda s: s.last_used):
        cache = engine.prefix_cache.evictable_blocks() if engine.prefix_cache is not None else 0
        if eng.num_free_blocks + cache >= blocks:
            break
        if s is not keep and not s.busy and s.seq is not None:
            freed += s.evict()
    return freed
