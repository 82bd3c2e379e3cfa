"""Context parallelism: the load-balanced sequence split and attention over it.

With ``context_parallel_size`` = cp, the sequence of length S is cut into 2 * cp chunks
of c = S / (2 * cp) tokens; CP rank r keeps chunks r and 2 * cp - 1 - r, concatenated in
that order (Megatron-LM's split). Under causal attention an early chunk is cheap and a
late chunk expensive, so pairing them gives every rank the same work.

Everything outside attention is per token and runs on the local 2c tokens unchanged; the
model is fed the local tokens' *global* position ids (``context_parallel_positions``),
which RoPE and learned position embeddings use as they are. Attention is the one place
where tokens meet; ``context_parallel_attention`` computes exact causal attention of the
local queries over the whole sequence, batch-first like attention.py: q [b, H, 2c, d],
k and v [b, G, 2c, d] (G query groups, query head h uses kv head h // (H / G)).

Packed documents (``document_mask.py``): given ``document_start``, the local queries'
first positions of their documents, every type keeps attention inside documents by the
same rule on global positions; blocks and the gathered sequence get their part of it.

Communication types (Megatron's ``cp_comm_type`` spellings):

* ``"p2p"``: a ring. K/V blocks travel around the CP group; each step attends the local
  queries to the block held, skipping chunk pairs that the causal mask hides entirely,
  and merges the partial results by their log-sum-exp. Backward is a second ring in
  which dK/dV accumulators travel with the K/V back to their owner.
* ``"all_gather"``: K and V (with G heads, before any GQA expansion) are all-gathered,
  the local queries attend to them under a mask built from global positions; backward
  reduce-scatters dK/dV.
* ``"a2a"`` (DeepSpeed Ulysses): all-to-alls trade heads for sequence, so each rank runs
  plain causal attention over the whole sequence for H / cp heads, then trades back.
* ``"a2a+p2p"`` (hierarchical): the CP group is a x p ranks; all-to-alls inside each a2a
  group of a consecutive CP ranks trade heads for their 2a chunks, and the ring runs
  over each p2p group (the ranks with the same heads in the p groups).
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .document_mask import document_allowed

SUPPORTED_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


# --------------------------------------------------------------------------------------
# The sequence split
# --------------------------------------------------------------------------------------


def _check_split(seq_len: int, cp_size: int, cp_rank: int) -> int:
    """The chunk length c = seq_len / (2 * cp_size), after checking the arguments."""
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}.")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}; pass the rank in the CP group.")
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * context_parallel_size = {2 * cp_size}; "
            f"pad or cut the sequences to a multiple of {2 * cp_size}."
        )
    return seq_len // (2 * cp_size)


def context_parallel_chunks(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two chunks (of 2 * cp_size) that CP rank ``cp_rank`` keeps, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def context_parallel_positions(seq_len: int, cp_size: int, cp_rank: int,
                               device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions [seq_len / cp_size] (int64) of the tokens CP rank ``cp_rank`` keeps."""
    c = _check_split(seq_len, cp_size, cp_rank)
    first, second = context_parallel_chunks(cp_size, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def split_for_context_parallel(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``tensor`` (tokens, labels, loss mask, position ids [b, s],
    or any tensor with the sequence on ``seq_dim``): chunks r and 2 * cp - 1 - r."""
    c = _check_split(tensor.shape[seq_dim], cp_size, cp_rank)
    if cp_size == 1:
        return tensor
    first, second = context_parallel_chunks(cp_size, cp_rank)
    return torch.cat([tensor.narrow(seq_dim, first * c, c), tensor.narrow(seq_dim, second * c, c)], dim=seq_dim)


def merge_context_parallel_splits(pieces: List[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The inverse of ``split_for_context_parallel``: every CP rank's piece, in rank order,
    back into the whole sequence."""
    cp = len(pieces)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * cp)
    for rank, piece in enumerate(pieces):
        if piece.shape[seq_dim] % 2:
            raise ValueError(f"a CP piece holds two equal chunks, but piece {rank} has odd length "
                             f"{piece.shape[seq_dim]} on dim {seq_dim}; pass split_for_context_parallel's outputs.")
        first, second = context_parallel_chunks(cp, rank)
        chunks[first], chunks[second] = piece.chunk(2, dim=seq_dim)
    return torch.cat(chunks, dim=seq_dim)


def gather_from_context_parallel(tensor: torch.Tensor, cp_group, seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's local piece (an all-gather; no gradient).
    For evaluation and tests, e.g. per-token losses back in sequence order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=cp_group)
    return merge_context_parallel_splits(pieces, seq_dim)


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


def check_cp_comm_type(comm_type: str) -> None:
    if comm_type not in SUPPORTED_CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type {comm_type!r} is not supported; use one of "
                         f"{', '.join(SUPPORTED_CP_COMM_TYPES)}.")


def check_heads_divisible(heads: int, groups: int, size: int, comm_type: str) -> None:
    """'a2a' and 'a2a+p2p' scatter whole heads and query groups over ``size`` ranks."""
    if heads % size or groups % size:
        raise ValueError(
            f"cp_comm_type {comm_type!r} scatters heads over {size} ranks: attention heads ({heads}) and query "
            f"groups ({groups}) per rank must be divisible by {size}; use 'p2p' or 'all_gather'."
        )


def check_hierarchical_groups(hierarchical_groups, cp_group) -> None:
    """'a2a+p2p' needs (a2a group, p2p group): CP rank o * a + i is rank i of an a2a group
    of a ranks and rank o of a p2p group, so that the sizes multiply to the CP size."""
    if not isinstance(hierarchical_groups, (list, tuple)) or len(hierarchical_groups) != 2:
        raise ValueError("cp_comm_type 'a2a+p2p' needs the hierarchical CP groups (a2a group, p2p group); "
                         "build them from --hierarchical-context-parallel-sizes.")
    inner, outer = hierarchical_groups
    a, p = dist.get_world_size(inner), dist.get_world_size(outer)
    expected = dist.get_rank(outer) * a + dist.get_rank(inner)
    if a * p != dist.get_world_size(cp_group) or expected != dist.get_rank(cp_group):
        raise ValueError(
            f"the hierarchical CP groups ({a} x {p} ranks) do not tile the CP group of "
            f"{dist.get_world_size(cp_group)}: CP rank o * a + i must be rank i of its a2a group and rank o of its "
            "p2p group (a2a groups of consecutive CP ranks)."
        )


def _sdpa(q, k, v, attn_mask, is_causal, dropout_p=0.0):
    """The default local attention: SDPA on [b, heads, s, d] (GQA without expanding k/v)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group,
                               comm_type: str = "p2p", *, dropout_p: float = 0.0,
                               local_attention: Optional[Callable] = None,
                               hierarchical_groups: Optional[Tuple] = None,
                               document_start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    q [b, H, 2c, d], k and v [b, G, 2c, d]: this rank's two chunks (the split above) in
    the cp_group; returns the context [b, H, 2c, d]. The softmax scale is 1/sqrt(d).

    ``local_attention(q, k, v, attn_mask, is_causal)`` (SDPA semantics: a bool mask is
    True where attention is allowed; GQA by head count) is the kernel "all_gather" and
    "a2a" run after their collectives, e.g. the attention module's own, which applies its
    dropout and kernel choice. Default: SDPA with ``dropout_p``. "p2p" and "a2a+p2p" run
    their own blockwise kernel in fp32 and apply ``dropout_p`` there. "a2a+p2p" needs
    ``hierarchical_groups`` = (a2a group, p2p group) (``check_hierarchical_groups``).
    ``document_start`` [b, 2c] (optional, packed documents): the global position where each
    local query's document starts; attention then stays inside documents.
    """
    check_cp_comm_type(comm_type)
    cp = dist.get_world_size(cp_group)
    heads, groups, s_local = q.shape[1], k.shape[1], q.shape[2]
    if s_local % 2:
        raise ValueError(f"the local sequence length {s_local} is odd, but a CP rank holds two equal chunks; "
                         "feed the model split_for_context_parallel's tokens.")
    if heads % groups:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({groups}); pass k and v "
                         "with the query groups' heads, unexpanded.")
    if local_attention is None:
        def local_attention(q_, k_, v_, attn_mask, is_causal):
            return _sdpa(q_, k_, v_, attn_mask, is_causal, dropout_p)
    if document_start is not None and tuple(document_start.shape) != (q.shape[0], s_local):
        raise ValueError(f"document_start must be [batch, local sequence] = {(q.shape[0], s_local)}, got "
                         f"{tuple(document_start.shape)}; split it with the tokens (split_for_context_parallel).")
    if comm_type == "p2p":
        ring_chunks = tuple(context_parallel_chunks(cp, r) for r in range(cp))
        return _RingAttention.apply(q, k, v, cp_group, ring_chunks, dropout_p, document_start)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, cp_group, local_attention, document_start)
    if comm_type == "a2a+p2p":
        check_hierarchical_groups(hierarchical_groups, cp_group)
        check_heads_divisible(heads, groups, dist.get_world_size(hierarchical_groups[0]), comm_type)
        return _hierarchical_attention(q, k, v, *hierarchical_groups, dropout_p, document_start)
    check_heads_divisible(heads, groups, cp, comm_type)
    return _ulysses_attention(q, k, v, cp_group, local_attention, document_start)


# ---- all_gather ----------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``seq_dim`` in CP-rank order; backward reduce-scatters (sums) the
    gradient back to each rank's piece."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        cp = dist.get_world_size(group)
        local = x.movedim(seq_dim, 0).contiguous()
        out = local.new_empty((cp * local.shape[0],) + local.shape[1:])
        dist.all_gather_single(out, local, group=group)
        return out.movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        full = grad.movedim(ctx.seq_dim, 0).contiguous()
        out = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group),) + full.shape[1:])
        dist.reduce_scatter_single(out, full, group=ctx.group)
        return out.movedim(0, ctx.seq_dim), None, None


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s_local] from every rank of ``group`` -> [b, size * s_local] in rank order (no
    gradient): the document starts of a gathered sequence."""
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.view(size, *x.shape).movedim(0, 1).reshape(x.shape[0], -1)


def _gathered_positions(s_local: int, cp: int, device) -> torch.Tensor:
    """Global positions of the sequence as gathered in CP-rank order (each rank's two chunks)."""
    return torch.cat([context_parallel_positions(s_local * cp, cp, r, device) for r in range(cp)])


def _all_gather_attention(q, k, v, group, local_attention, document_start=None):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[2]
    kv = _GatherSequence.apply(torch.stack([k, v]), group, 3)  # one collective; G heads, not H
    q_pos = context_parallel_positions(s_local * cp, cp, rank, q.device)
    k_pos = _gathered_positions(s_local, cp, q.device)
    if document_start is None:
        allowed = q_pos[:, None] >= k_pos[None, :]  # [2c, S]
    else:
        allowed = document_allowed(document_start, q_pos, k_pos).unsqueeze(1)  # [b, 1, 2c, S]
    return local_attention(q, kv[0], kv[1], allowed, False)


# ---- a2a (Ulysses) -------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into cp pieces along ``scatter_dim``, send piece j to CP rank j, and
    concatenate the pieces received (in rank order) along ``gather_dim``. Backward is the
    same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x, group, scatter_dim, gather_dim):
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def _ulysses_attention(q, k, v, group, local_attention, document_start=None):
    cp = dist.get_world_size(group)
    s_local = q.shape[2]
    # [b, heads, 2c, d] -> [b, heads / cp, S, d]: this rank's heads, whole sequence in
    # CP-rank order; then into sequence order for plain causal attention.
    positions = _gathered_positions(s_local, cp, q.device)
    order = torch.argsort(positions)
    q_all = _AllToAll.apply(q, group, 1, 2).index_select(2, order)
    kv_all = _AllToAll.apply(torch.stack([k, v]), group, 2, 3).index_select(3, order)
    if document_start is None:
        context = local_attention(q_all, kv_all[0], kv_all[1], None, True)
    else:  # every rank now holds every query: the whole sequence's document starts
        starts = _gather_tokens(document_start, group).index_select(1, order)
        whole = torch.arange(starts.shape[1], device=q.device)
        context = local_attention(q_all, kv_all[0], kv_all[1], document_allowed(starts, whole, whole).unsqueeze(1),
                                  False)
    # Back to CP-rank order (the gathered token at index i has position positions[i]), then
    # to [b, heads, 2c, d].
    return _AllToAll.apply(context.index_select(2, positions), group, 2, 1)


# ---- a2a+p2p (hierarchical) ----------------------------------------------------------


def _hierarchical_attention(q, k, v, a2a_group, p2p_group, dropout_p, document_start=None):
    a, p = dist.get_world_size(a2a_group), dist.get_world_size(p2p_group)
    cp = a * p
    # [b, heads, 2c, d] -> [b, heads / a, 2a * c, d]: this rank's heads for the chunks of
    # its a2a group, in CP-rank order. The ring needs no reordering: it compares chunk
    # indices, and a chunk's tokens stay in order.
    q_group = _AllToAll.apply(q, a2a_group, 1, 2)
    kv_group = _AllToAll.apply(torch.stack([k, v]), a2a_group, 2, 3)
    ring_chunks = tuple(tuple(chunk for i in range(a) for chunk in context_parallel_chunks(cp, o * a + i))
                        for o in range(p))
    starts = None if document_start is None else _gather_tokens(document_start, a2a_group)
    context = _RingAttention.apply(q_group, kv_group[0], kv_group[1], p2p_group, ring_chunks, dropout_p, starts)
    return _AllToAll.apply(context, a2a_group, 2, 1)


# ---- p2p (ring) ----------------------------------------------------------------------


class _Ring:
    """Point-to-point exchanges with the CP neighbours: send to rank + 1, receive from
    rank - 1 (one batched isend/irecv pair per exchange, waited on later)."""

    def __init__(self, group):
        self.group = group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def exchange(self, send: torch.Tensor, tag: int):
        """Post the exchange; returns (receive buffer, requests)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(posted):
        recv, requests = posted
        for request in requests:
            request.wait()
        return recv


_KV_TAG, _DKV_TAG = 1, 2  # the two exchanges may be in flight to the same peer at once


def _chunk_pairs(q_chunks: Tuple[int, ...], k_chunks: Tuple[int, ...], earliest: Optional[List[int]] = None,
                 c: int = 0):
    """(query chunk i, key chunk j, causal?) of the local chunks (global chunk indices
    ``q_chunks``) and a K/V block's (``k_chunks``) that the causal mask does not hide
    entirely. Chunk pairs with a later key chunk are skipped; a chunk with itself needs
    the triangular mask. With packed documents (``earliest``: per local query chunk the
    earliest document start of its queries; ``c`` tokens per chunk) so are key chunks
    that end before every query's document begins."""
    return [(i, j, qc == kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(k_chunks)
            if qc >= kc and (earliest is None or earliest[i] < (kc + 1) * c)]


def _earliest_starts(starts) -> Optional[List[int]]:
    """Per local query chunk, the earliest document start of its queries (whole batch),
    read on the host once per forward / backward: which key chunks no query can see."""
    return None if starts is None else [int(chunk.min()) for chunk in starts]


def _dropout_keep(seed: int, step: int, i: int, j: int, n: int, shape, p: float, device) -> Optional[torch.Tensor]:
    """The keep mask of one block (step, query chunk i, key chunk j of n each), drawn from a
    generator seeded by (seed, block), so the backward draws the same mask without storing
    it. None without dropout."""
    if p == 0.0:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + (step * n + i) * n + j) % (2 ** 63))
    return torch.rand(shape, generator=generator, device=device) >= p


def _hidden(starts, i, q_chunk, k_chunk, c, causal, device) -> Optional[torch.Tensor]:
    """The keys of block (query chunk ``q_chunk``, key chunk ``k_chunk``, global indices)
    that its queries may not see, broadcastable to the scores [b, G, P, c, c]: the
    triangle on the diagonal; with packed documents (``starts``: the local query chunks'
    document starts) also the keys of earlier documents. None where nothing is hidden."""
    if starts is None:
        return torch.ones(c, c, dtype=torch.bool, device=device).triu(1) if causal else None
    q_pos = torch.arange(q_chunk * c, (q_chunk + 1) * c, device=device)
    k_pos = torch.arange(k_chunk * c, (k_chunk + 1) * c, device=device)
    return ~document_allowed(starts[i], q_pos, k_pos)[:, None, None]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query row whose keys are all hidden in a block: packed
    documents) replaced by 0, to subtract safely: exp(-inf - 0) = 0."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _scores(q, k, scale, hidden):
    """q [b, G, P, c, d] against k [b, G, c', d] -> [b, G, P, c, c'] (no GQA expansion),
    -inf where ``hidden``."""
    b, g, p, c, d = q.shape
    scores = (q.reshape(b, g, p * c, d) @ k.transpose(-1, -2)).view(b, g, p, c, k.shape[-2]) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _weighted(p, v):
    """p [b, G, P, c, c'] times v [b, G, c', d] -> [b, G, P, c, d]."""
    b, g, h, c, c2 = p.shape
    return (p.reshape(b, g, h * c, c2) @ v).view(b, g, h, c, v.shape[-1])


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``group``, whose rank r holds the global chunks
    ``ring_chunks[r]`` (c tokens each) of q, k and v: (r, 2 * cp - 1 - r) for "p2p", the
    chunks of an a2a group for "a2a+p2p". Internally in at least fp32, with the queries as
    [b, G, P, s, d] so that GQA never expands K/V, and per local query chunk a running
    output and log-sum-exp. Merging a block (o, l) into (O, L): L' = logaddexp(L, l),
    O' = O * exp(L - L') + o * exp(l - L'). With packed documents (``document_start``,
    the held queries') a block may hide all keys of a query (l = -inf, o = 0); every
    query sees itself, so its final L is finite."""

    @staticmethod
    def forward(ctx, q, k, v, group, ring_chunks, dropout_p, document_start=None):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, heads, s, d = q.shape
        n = len(ring_chunks[rank])
        groups, c = k.shape[1], s // n
        scale = d ** -0.5
        seed = int(torch.randint(0, 2 ** 62, ()).item()) if dropout_p > 0 else 0
        acc = _accumulation_dtype(q)
        q5 = q.to(acc).reshape(b, groups, heads // groups, s, d)
        qs = q5.split(c, dim=3)
        starts = None if document_start is None else document_start.split(c, dim=1)
        earliest = _earliest_starts(starts)
        kv = torch.stack([k, v]).to(acc).contiguous()
        ring = _Ring(group)
        out: List[Optional[torch.Tensor]] = [None] * n
        lse: List[Optional[torch.Tensor]] = [None] * n
        for step in range(cp):
            # Post the next block's exchange first, so it travels while this one computes.
            posted = ring.exchange(kv, _KV_TAG) if step + 1 < cp else None
            src = (rank - step) % cp
            ks, vs = kv[0].split(c, dim=2), kv[1].split(c, dim=2)
            for i, j, causal in _chunk_pairs(ring_chunks[rank], ring_chunks[src], earliest, c):
                hidden = _hidden(starts, i, ring_chunks[rank][i], ring_chunks[src][j], c, causal, q.device)
                scores = _scores(qs[i], ks[j], scale, hidden)
                block_lse = scores.logsumexp(dim=-1)
                probs = torch.exp(scores - _finite(block_lse).unsqueeze(-1))
                keep = _dropout_keep(seed, step, i, j, n, probs.shape, dropout_p, q.device)
                if keep is not None:
                    probs = probs * keep / (1 - dropout_p)
                block_out = _weighted(probs, vs[j])
                if out[i] is None:
                    out[i], lse[i] = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse[i], block_lse)
                    shift = _finite(merged)
                    out[i] = out[i] * torch.exp(lse[i] - shift).unsqueeze(-1) + \
                        block_out * torch.exp(block_lse - shift).unsqueeze(-1)
                    lse[i] = merged
            if posted is not None:
                kv = _Ring.wait(posted)
        # Every query chunk saw at least its own chunk (the diagonal block), so none is None.
        out_all, lse_all = torch.cat(out, dim=3), torch.cat(lse, dim=3)
        ctx.save_for_backward(q, k, v, out_all, lse_all, document_start)
        ctx.group, ctx.ring_chunks, ctx.dropout_p, ctx.seed = group, ring_chunks, dropout_p, seed
        return out_all.reshape(b, heads, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, document_start = ctx.saved_tensors
        group, ring_chunks, dropout_p, seed = ctx.group, ctx.ring_chunks, ctx.dropout_p, ctx.seed
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, heads, s, d = q.shape
        n = len(ring_chunks[rank])
        groups, c = k.shape[1], s // n
        scale = d ** -0.5
        acc = _accumulation_dtype(q)
        q5 = q.to(acc).reshape(b, groups, heads // groups, s, d)
        dout = grad_out.to(acc).reshape(q5.shape)
        # Softmax backward needs rowsum(P * dP) = rowsum(dO * O) per query (with or
        # without dropout), known here from the merged output.
        delta = (dout * out).sum(dim=-1)
        qs, douts = q5.split(c, dim=3), dout.split(c, dim=3)
        starts = None if document_start is None else document_start.split(c, dim=1)
        earliest = _earliest_starts(starts)
        lses, deltas = lse.split(c, dim=3), delta.split(c, dim=3)
        dq = torch.zeros_like(q5)
        dqs = dq.split(c, dim=3)  # views: accumulating into them fills dq
        kv = torch.stack([k, v]).to(acc).contiguous()
        ring = _Ring(group)
        dkv_posted = None
        for step in range(cp):
            posted = ring.exchange(kv, _KV_TAG) if step + 1 < cp else None
            src = (rank - step) % cp
            ks, vs = kv[0].split(c, dim=2), kv[1].split(c, dim=2)
            dkv = torch.zeros_like(kv)  # this rank's share of the held block's dK, dV
            dks, dvs = dkv[0].split(c, dim=2), dkv[1].split(c, dim=2)
            for i, j, causal in _chunk_pairs(ring_chunks[rank], ring_chunks[src], earliest, c):
                hidden = _hidden(starts, i, ring_chunks[rank][i], ring_chunks[src][j], c, causal, q.device)
                scores = _scores(qs[i], ks[j], scale, hidden)
                probs = torch.exp(scores - lses[i].unsqueeze(-1))  # the final softmax (masked -> 0)
                dprobs = _weighted_t(douts[i], vs[j])
                keep = _dropout_keep(seed, step, i, j, n, probs.shape, dropout_p, q.device)
                if keep is None:
                    dvs[j].add_(_transposed_weighted(probs, douts[i]))
                else:
                    dvs[j].add_(_transposed_weighted(probs * keep / (1 - dropout_p), douts[i]))
                    dprobs = dprobs * keep / (1 - dropout_p)
                dscores = probs * (dprobs - deltas[i].unsqueeze(-1)) * scale
                dqs[i].add_(_weighted(dscores, ks[j]))
                dks[j].add_(_transposed_weighted(dscores, qs[i]))
            if dkv_posted is not None:
                # The accumulator of the block held now arrives from the previous rank,
                # which held it in the step before.
                dkv += _Ring.wait(dkv_posted)
            # Pass it on; after the last step this hop brings each block home.
            dkv_posted = ring.exchange(dkv, _DKV_TAG) if cp > 1 else None
            if posted is not None:
                kv = _Ring.wait(posted)
        if dkv_posted is not None:
            dkv = _Ring.wait(dkv_posted)
        dq = dq.reshape(b, heads, s, d).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (scores, softmax and merges), fp64 stays fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _weighted_t(dout, v):
    """dO [b, G, P, c, d] times v^T [b, G, d, c'] -> [b, G, P, c, c']."""
    b, g, p, c, d = dout.shape
    return (dout.reshape(b, g, p * c, d) @ v.transpose(-1, -2)).view(b, g, p, c, v.shape[-2])


def _transposed_weighted(p, x):
    """p^T [b, G, c', P * c] times x [b, G, P * c, d] -> [b, G, c', d] (sums over P heads)."""
    b, g, h, c, c2 = p.shape
    return p.reshape(b, g, h * c, c2).transpose(-1, -2) @ x.reshape(b, g, h * c, x.shape[-1])
