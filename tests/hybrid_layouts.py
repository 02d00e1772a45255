"""Cache layouts of hybrid models, shared by the core tests and the transport contract.

Sizes are small (the contract suite runs them between processes) but the
shapes are the real ones: several owners per request, one block pool, one
region shared by two groups, state slots with trailing scratch slots.
"""

from __future__ import annotations

from kvhandoff.core.groups import CacheGroup, CacheKind, CacheLayout, CacheRegion

NUM_BLOCKS = 64
BLOCK_SIZE = 16  # tokens per block
WINDOW = 32  # tokens

MAIN_KV = (CacheRegion("main.kv.0", 512), CacheRegion("main.kv.1", 512))


def qsa_layout(num_blocks: int = NUM_BLOCKS) -> CacheLayout:
    """The seed's owners: main KV + indexer cache, GDN state, per-layer embedding,
    and a sliding-window group overlaid on the main KV's tensors (vLLM's hybrid
    allocator: one tensor per layer slot, the groups apart by block ids)."""
    return CacheLayout((
        CacheGroup(0, CacheKind.FULL_ATTENTION, BLOCK_SIZE, num_blocks, MAIN_KV,
                   ("layers.0.attn", "layers.2.attn"), owner="main_kv"),
        CacheGroup(1, CacheKind.INDEXER, BLOCK_SIZE, num_blocks, (CacheRegion("indexer.0", 128),),
                   ("layers.0.indexer",), owner="indexer"),
        CacheGroup(2, CacheKind.LINEAR_STATE, 1024, num_blocks,
                   (CacheRegion("gdn.1", 1024, (("conv", 0, 256), ("ssm", 256, 768))),),
                   ("layers.1.gdn",), spec_slots=1, owner="gdn"),
        CacheGroup(3, CacheKind.LAYER_EMBEDDING, 1024, num_blocks, (CacheRegion("ple", 64),),
                   ("ple",), owner="ple"),
        CacheGroup(4, CacheKind.SLIDING_WINDOW, BLOCK_SIZE, num_blocks, MAIN_KV,
                   ("layers.1.attn", "layers.3.attn"), window=WINDOW, owner="swa"),
    ))


# One request of 100 tokens: 7 blocks of 16 tokens.  Ids come from one pool, so no
# two groups share an id (which matters where they share a region: groups 0 and 4).
NUM_TOKENS = 100
P_IDS = ([3, 4, 5, 6, 20, 21, 22],  # main KV: runs 3..6 and 20..22
         [40, 41, 42, 43, 44, 45, 46],  # indexer
         [50, 51],  # GDN: running state 50, scratch 51
         [52],  # PLE
         [0, 0, 0, 0, 30, 31, 9])  # window: null blocks (0) out of the window, then the tail
D_IDS = ([10, 11, 12, 13, 14, 15, 16],
         [10, 11, 12, 13, 14, 15, 16],  # another region: the same ids are other bytes
         [7, 8],
         [9],
         [0, 0, 0, 0, 40, 41, 42])
# What the plan reads, per group: (remote ids, local ids).
EXPECTED = {0: (P_IDS[0], D_IDS[0]), 1: (P_IDS[1], D_IDS[1]), 2: ([50], [7]), 3: ([52], [9]),
            4: ([30, 31, 9], [40, 41, 42])}


def one_group_layout(layers: list[str], num_blocks: int, block_size: int,
                     page_bytes: int) -> CacheLayout:
    """A plain model's layout: one full-attention group, one layer-outermost tensor."""
    from kvhandoff.core.groups import TensorPlacement, tensor_regions

    size = len(layers) * num_blocks * page_bytes
    regions = tensor_regions([TensorPlacement(size, tuple(layers), num_blocks * page_bytes,
                                              page_bytes)], dict.fromkeys(layers, page_bytes),
                             num_blocks)
    return CacheLayout((CacheGroup(0, CacheKind.FULL_ATTENTION, block_size, num_blocks,
                                   tuple(regions[x] for x in layers), tuple(layers)),))


def gemma_layout(num_blocks: int, block_size: int, page_bytes: int, window: int,
                 layers: int = 4) -> CacheLayout:
    """A Gemma-3-style layout as vLLM 0.32 builds it: even layers sliding, odd layers
    full attention, the two groups overlaid layer slot by layer slot on one allocation."""
    from kvhandoff.core.groups import TensorPlacement, tensor_regions

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    sw, full = names[0::2], names[1::2]
    slot = num_blocks * page_bytes
    size = len(sw) * slot
    regions = tensor_regions([TensorPlacement(size, tuple(sw), slot, page_bytes),
                              TensorPlacement(size, tuple(full), slot, page_bytes)],
                             dict.fromkeys(names, page_bytes), num_blocks)
    return CacheLayout((
        CacheGroup(0, CacheKind.SLIDING_WINDOW, block_size, num_blocks,
                   tuple(regions[x] for x in sw), tuple(sw), window=window),
        CacheGroup(1, CacheKind.FULL_ATTENTION, block_size, num_blocks,
                   tuple(regions[x] for x in full), tuple(full)),
    ))
