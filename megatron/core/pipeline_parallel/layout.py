"""Which transformer layers each pipeline stage (and virtual stage) holds.

The model is cut into ``pp_size x vp_size`` chunks. Chunk ``c = v * pp_size + r`` is
virtual stage ``v`` of pipeline rank ``r`` (Megatron's order: rank 0 holds chunks 0,
p, 2p, ...), and the chunks hold consecutive global layers in chunk order. Layer numbers
are global, so a layer's parameter names, its initialization and its checkpoint entries
do not depend on the layout.

Four ways to say how many layers a chunk gets, as Megatron's flags do:

* even: ``num_layers / (pp x vp)`` each;
* ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: the
  first / last pipeline rank gets that many (split evenly over its virtual stages), the
  other ranks share the rest evenly;
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
  the embedding (the loss) counts as one layer of the first (last) chunk;
* ``--pipeline-model-parallel-layout``: an explicit string, chunks separated by ``|``,
  ``E`` the embedding, ``t`` a transformer layer, ``m`` a multi-token prediction depth,
  ``L`` the loss, ``X*n`` and ``(...)*n`` repeat, commas are cosmetic (e.g.
  ``"Et|(tt|)*2tL"``, ``"Et*3|t*3|mL"``).

Multi-token prediction (``--mtp-num-layers``) runs on the last chunk, after its decoder
layers and before the loss (upstream's default placement). A layout string must then name
its depths there, ``m`` once per depth right before ``L``; upstream's other placement (the
depths on an earlier stage, "standalone") is not built here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    pp_size: int
    vp_size: int
    # chunk_layers[c]: the global (0-based) layer indices of chunk c = v * pp_size + r
    chunk_layers: Tuple[Tuple[int, ...], ...]

    def layers_of(self, pp_rank: int, vp_stage: int = 0) -> Tuple[int, ...]:
        return self.chunk_layers[vp_stage * self.pp_size + pp_rank]

    def is_first_chunk(self, pp_rank: int, vp_stage: int = 0) -> bool:
        """Whether this chunk holds the embedding (Megatron's ``pre_process``)."""
        return pp_rank == 0 and vp_stage == 0

    def is_last_chunk(self, pp_rank: int, vp_stage: int = 0) -> bool:
        """Whether this chunk holds the final norm, the output layer and the loss (``post_process``)."""
        return pp_rank == self.pp_size - 1 and vp_stage == self.vp_size - 1

    def describe(self) -> str:
        rows = []
        for r in range(self.pp_size):
            chunks = [self.layers_of(r, v) for v in range(self.vp_size)]
            rows.append(f"  stage {r}: " + " | ".join(_span(c) for c in chunks))
        return "\n".join(rows)


def _span(layers: Sequence[int]) -> str:
    return f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"


def _assign(counts: Sequence[int], pp_size: int, vp_size: int) -> PipelineLayout:
    chunks, start = [], 0
    for count in counts:
        chunks.append(tuple(range(start, start + count)))
        start += count
    return PipelineLayout(pp_size, vp_size, tuple(chunks))


def parse_layout_string(layout: str) -> List[str]:
    """``"Et|(tt|)*2tL"`` -> ``["Et", "tt", "tt", "tL"]`` (one string per chunk)."""
    text = layout.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    chunks = text.split("|")
    for chunk in chunks:
        bad = set(chunk) - set("EtmL")
        if bad:
            raise ValueError(
                f"--pipeline-model-parallel-layout {layout!r} has {''.join(sorted(bad))!r}: only E (embedding), "
                "t (transformer layer), m (multi-token prediction depth), L (loss), '|' between chunks, X*n and "
                "(...)*n are understood here."
            )
    return chunks


def build_pipeline_layout(num_layers: int, pp_size: int, vp_size: int = 1, *,
                          first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                          account_for_embedding: bool = False, account_for_loss: bool = False,
                          layout: Optional[str] = None, mtp_num_layers: Optional[int] = None) -> PipelineLayout:
    """The layout for these flags, or a ValueError that names the flag to change."""
    if layout is not None:
        return _from_string(layout, num_layers, pp_size, mtp_num_layers or 0)
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and (account_for_embedding or account_for_loss):
        raise ValueError("--decoder-first/last-pipeline-num-layers already place every layer; drop "
                         "--account-for-embedding/loss-in-pipeline-split, or drop the explicit layer counts.")
    if uneven:
        return _uneven(num_layers, pp_size, vp_size, first_stage_layers, last_stage_layers)
    extra_first, extra_last = int(account_for_embedding), int(account_for_loss)
    total = num_layers + extra_first + extra_last
    chunks = pp_size * vp_size
    if total % chunks:
        what = "--num-layers" + (" (+1 for the embedding)" if extra_first else "") + \
            (" (+1 for the loss)" if extra_last else "")
        raise ValueError(
            f"{what} = {total} must be divisible by --pipeline-model-parallel-size ({pp_size}) x virtual stages "
            f"({vp_size}) = {chunks}; change the layer count or the sizes, or place layers with "
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers."
        )
    counts = [total // chunks] * chunks
    counts[0] -= extra_first
    counts[-1] -= extra_last
    if min(counts) < 0:
        raise ValueError("a pipeline chunk would hold the embedding or the loss and fewer than zero layers; "
                         "use more layers or fewer stages.")
    return _assign(counts, pp_size, vp_size)


def _uneven(num_layers: int, pp_size: int, vp_size: int, first: Optional[int], last: Optional[int]) -> PipelineLayout:
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and (value < 0 or value % vp_size):
            raise ValueError(f"{flag} ({value}) must be a non-negative multiple of the virtual stages per rank "
                             f"({vp_size}), so that each virtual stage gets the same number.")
    fixed = [r for r, value in ((0, first), (pp_size - 1, last)) if value is not None]
    if pp_size == 1:
        raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1; drop them.")
    middle_stages = pp_size - len(fixed)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages and rest % (middle_stages * vp_size)) or (not middle_stages and rest):
        raise ValueError(
            f"after --decoder-first/last-pipeline-num-layers, {rest} of the {num_layers} layers remain for "
            f"{middle_stages} other pipeline stage(s) x {vp_size} virtual stage(s); they must split evenly."
        )
    per_rank = [rest // middle_stages if middle_stages else 0] * pp_size
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    counts = [per_rank[r] // vp_size for v in range(vp_size) for r in range(pp_size)]
    return _assign(counts, pp_size, vp_size)


def _from_string(layout: str, num_layers: int, pp_size: int, mtp_num_layers: int = 0) -> PipelineLayout:
    chunks = parse_layout_string(layout)
    if len(chunks) % pp_size:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} has {len(chunks)} chunks, which is not a "
                         f"multiple of --pipeline-model-parallel-size ({pp_size}).")
    flat = "".join(chunks)
    if flat.count("E") != 1 or flat.count("L") != 1 or not chunks[0].startswith("E") or not chunks[-1].endswith("L"):
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} must begin with E (in the first chunk) and end "
                         "with L (in the last), each exactly once.")
    if flat.count("t") != num_layers:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} places {flat.count('t')} transformer layers, "
                         f"--num-layers is {num_layers}; make them agree.")
    if flat.count("m") != mtp_num_layers:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} places {flat.count('m')} multi-token "
                         f"prediction depths (m), --mtp-num-layers is {mtp_num_layers}; make them agree.")
    if mtp_num_layers and not chunks[-1].endswith("m" * mtp_num_layers + "L"):
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: the multi-token prediction depths run on the "
                         f"last chunk here, right before the loss; end the layout with {'m' * mtp_num_layers + 'L'!r}.")
    return _assign([c.count("t") for c in chunks], pp_size, len(chunks) // pp_size)
