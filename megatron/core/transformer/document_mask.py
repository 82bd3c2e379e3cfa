"""Packed documents: causal attention that stays inside each document.

With ``--reset-attention-mask`` a training sequence holds several documents, each ended
by an EOD token; a token attends to the tokens of its own document up to itself, never
to an earlier document (upstream Megatron-LM's ``_get_ltor_masks_and_position_ids``).
Documents are contiguous, so one number per token says it all: ``document_start``, the
global position (in the whole, unsplit sequence) of the first token of the token's
document. Query q may attend key k exactly when

    document_start[q] <= position[k] <= position[q]

This needs nothing about the keys but their positions, which every attention path
knows: so under context parallelism ``document_start`` is split with the tokens and each
CP rank holds its queries' starts only (``context_parallel.py`` builds the mask of each
block it computes), and under sequence parallelism attention sees the whole sequence
anyway. ``GPTModel`` takes a ``DocumentMask`` where it takes an attention mask.
"""

from typing import Callable, List, Optional, Tuple

import torch


def document_allowed(document_start: torch.Tensor, query_positions: torch.Tensor,
                     key_positions: torch.Tensor) -> torch.Tensor:
    """[b, sq, sk] bool, True where a query may attend a key: the key lies in the query's
    document, at or before it. ``document_start`` [b, sq] and ``query_positions`` [sq]
    are the queries', ``key_positions`` [sk] the keys' (global positions)."""
    keys = key_positions.view(1, 1, -1)
    return (keys <= query_positions.view(1, -1, 1)) & (keys >= document_start.unsqueeze(-1))


class DocumentMask:
    """Which keys each query attends to when documents are packed into one sequence.

    ``document_start`` [b, s] int: for each token this rank holds (under context
    parallelism, its CP split), the global position of its document's first token.

    On the whole sequence attention runs one of two ways: per document (``segments``:
    plain causal attention on each document's slice, sum of L_i^2 work, one kernel call
    per document) when documents are long on average (``min_mean_length`` tokens, default
    64), else one call with the dense block-diagonal mask (``sdpa_mask``: s^2 work, no
    per-call overhead). The result is the same; only the cost differs.
    """

    def __init__(self, document_start: torch.Tensor, min_mean_length: int = 64):
        if document_start.dim() != 2 or document_start.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"document_start must be an integer tensor [batch, sequence], got shape "
                             f"{tuple(document_start.shape)} and dtype {document_start.dtype}.")
        self.document_start = document_start
        self.min_mean_length = min_mean_length
        self._sdpa_mask: Optional[torch.Tensor] = None
        self._segments: Optional[List[List[Tuple[int, int]]]] = None

    def segments(self, seq_len: int) -> Optional[List[List[Tuple[int, int]]]]:
        """Per batch row, the documents' [start, end) token ranges, when per-document
        attention is the cheaper way (see the class); None for the dense mask. Reads the
        starts on the host once per microbatch."""
        self._check_length(seq_len)
        if self._segments is None:
            b, s = self.document_start.shape
            starts = self.document_start.cpu()
            # A document begins where a token's start is its own position.
            begins = [torch.nonzero(row == torch.arange(s)).flatten().tolist() for row in starts]
            if any(not row or row[0] != 0 for row in begins):
                raise ValueError("document_start must hold the whole sequence's starts (the first token starts a "
                                 "document); a context-parallel split goes to the context-parallel attention.")
            count = sum(len(row) for row in begins)
            dense = count * self.min_mean_length > b * s
            self._segments = [] if dense else [list(zip(row, row[1:] + [s])) for row in begins]
        return self._segments or None

    def _check_length(self, seq_len: int) -> None:
        if self.document_start.shape[1] != seq_len:
            raise ValueError(f"the document mask covers {self.document_start.shape[1]} tokens but attention sees "
                             f"{seq_len}; under context parallelism pass the CP split's document starts to the "
                             "context-parallel attention, elsewhere the whole sequence's.")

    def sdpa_mask(self, seq_len: int) -> torch.Tensor:
        """The whole-sequence mask for SDPA, [b, 1, s, s] bool (True: attend). Built once
        per microbatch and shared by every layer."""
        self._check_length(seq_len)
        if self._sdpa_mask is None:
            positions = torch.arange(seq_len, device=self.document_start.device)
            self._sdpa_mask = document_allowed(self.document_start, positions, positions).unsqueeze(1)
        return self._sdpa_mask


def per_document_attention(attention: Callable, q, k, v, attn_mask=None, is_causal=True, *,
                           segments: List[List[Tuple[int, int]]]) -> torch.Tensor:
    """``attention(q, k, v, attn_mask, is_causal)`` (SDPA semantics, [b, heads, s, d]) run
    causally on each document's slice of each row, the results put back in place (the
    signature of ``attention`` itself; ``attn_mask`` and ``is_causal`` are not used)."""
    rows = []
    for r, ranges in enumerate(segments):
        rows.append(torch.cat([attention(q[r:r + 1, :, a:e], k[r:r + 1, :, a:e], v[r:r + 1, :, a:e], None, True)
                               for a, e in ranges], dim=2))
    return torch.cat(rows, dim=0)


def sdpa_mask_and_causal(attention_mask, seq_len: int, device) -> Tuple[Optional[torch.Tensor], bool]:
    """(attn_mask, is_causal) for SDPA from a model's ``attention_mask``: None -> SDPA's
    own causal mask (no dense mask); a ``DocumentMask`` -> its block-diagonal causal mask;
    a tensor (Megatron's convention, True where attention is NOT allowed) -> combined with
    the causal mask (SDPA cannot take both)."""
    if attention_mask is None:
        return None, True
    if isinstance(attention_mask, DocumentMask):
        return attention_mask.sdpa_mask(seq_len), False
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return causal & ~attention_mask.to(torch.bool), False
