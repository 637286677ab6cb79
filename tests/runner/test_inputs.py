"""build_inputs: one scheduler decision -> the flat tensors of a forward pass.

Each test lays out a small batch by hand (block size 4, block tables scattered over the pool), so
the expected rows, positions and slots are worked out on paper, not recomputed the way the code
computes them.
"""
from __future__ import annotations

from conveyor.kv.manager import KVCacheManager
from conveyor.request import Request
from conveyor.runner.inputs import ModelInputs, build_inputs
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler import SchedulerOutput

BS = 4


def request(request_id: str, prompt: list[int], outputs: tuple[int, ...] = (), computed: int = 0,
            n: int = 1) -> Request:
    r = Request(request_id, list(prompt), SamplingParams(max_tokens=32, n=n), arrival_time=0.0)
    r.output_token_ids = list(outputs)
    r.num_computed_tokens = computed
    return r


def kv_with_tables(tables: dict[str, list[int]], num_blocks: int = 16) -> KVCacheManager:
    """A KV manager whose requests hold exactly the given blocks (taken from the pool in that order)."""
    kv = KVCacheManager(num_blocks, BS)
    kv.pool.allocate(num_blocks)  # take every block, then give each request its own
    for request_id, table in tables.items():
        kv.block_tables[request_id] = list(table)
        kv.num_slotted_tokens[request_id] = len(table) * BS
    return kv


def inputs_of(out: SchedulerOutput, kv: KVCacheManager) -> ModelInputs:
    """build_inputs on the decision carrying the manager's block tables, as the scheduler's does."""
    out.block_tables = dict(kv.block_tables)
    return build_inputs(out, kv.block_size)


def test_decode_rows_come_first_then_prefill_chunks() -> None:
    # The scheduler hands out a prefill before two decodes; the decodes still take rows 0 and 1.
    p = request("P", [11, 12, 13, 14, 15])
    d1 = request("D1", [21, 22, 23], computed=3, outputs=(24,))    # decodes its token 24 at position 3
    d2 = request("D2", [31, 32], computed=2, outputs=(33,))         # token 33 at position 2
    kv = kv_with_tables({"P": [9, 3], "D1": [5], "D2": [12]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(p, 5), (d1, 1), (d2, 1)]), kv)

    assert inputs.input_ids.tolist() == [24, 33, 11, 12, 13, 14, 15]
    assert inputs.positions.tolist() == [3, 2, 0, 1, 2, 3, 4]
    assert inputs.meta.num_decode_tokens == 2
    (chunk,) = inputs.meta.prefills
    assert (chunk.token_start, chunk.num_tokens, chunk.num_cached) == (2, 5, 0)
    assert chunk.block_table.tolist() == [9, 3]
    # Every request samples: rows 0 and 1 for the decodes, the prefill's last row (6) for P, in the
    # scheduler's order (P first).
    assert inputs.logits_indices.tolist() == [6, 0, 1]


def test_slot_mapping_follows_each_request_s_scattered_blocks() -> None:
    # A: positions 6, 7 (second block, 2) of table [7, 2]; B: position 0-4 over table [4, 10].
    a = request("A", [1, 2, 3, 4, 5, 6, 7, 8], computed=6)
    b = request("B", [1, 2, 3, 4, 5])
    kv = kv_with_tables({"A": [7, 2], "B": [4, 10]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(a, 2), (b, 5)]), kv)

    # slot = block * 4 + offset: A's 6 and 7 are block 2, offsets 2 and 3; B's 0-3 are block 4,
    # its 4 is block 10, offset 0.
    assert inputs.meta.slot_mapping.tolist() == [10, 11, 16, 17, 18, 19, 40]
    assert len(set(inputs.meta.slot_mapping.tolist())) == 7


def test_decode_slot_in_a_fresh_block() -> None:
    # Position 8 opens the third block (index 2) of the table.
    r = request("R", [1, 2, 3, 4, 5, 6, 7, 8], outputs=(9,), computed=8)
    kv = kv_with_tables({"R": [3, 0, 14]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(r, 1)]), kv)
    assert inputs.meta.slot_mapping.tolist() == [14 * BS]
    assert inputs.input_ids.tolist() == [9] and inputs.positions.tolist() == [8]
    assert inputs.meta.decode_context_lens.tolist() == [9]


def test_decode_block_tables_are_padded_to_the_longest_context() -> None:
    short = request("S", [1, 2], outputs=(3,), computed=2)                   # context 3: 1 block
    long = request("L", list(range(1, 10)), outputs=(10,), computed=9)      # context 10: 3 blocks
    ahead = request("A", [1, 2, 3, 4], outputs=(5,), computed=4)            # context 5: 2 blocks of its 4
    kv = kv_with_tables({"S": [6], "L": [1, 8, 13], "A": [2, 5, 11, 15]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(short, 1), (long, 1), (ahead, 1)]), kv)

    # Width 3 (the longest context's blocks); shorter tables padded with block 0, a table with
    # blocks beyond the width cut to it.
    assert inputs.meta.decode_block_tables.tolist() == [[6, 0, 0], [1, 8, 13], [2, 5, 11]]
    assert inputs.meta.decode_context_lens.tolist() == [3, 10, 5]
    assert inputs.meta.prefills == []


def test_a_prefill_chunk_starts_after_its_cached_tokens_and_samples_only_at_the_end() -> None:
    # 10 prompt tokens, 4 already cached: this chunk computes positions 4-7, so it does not sample.
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    mid = request("M", prompt, computed=4)
    last = request("E", prompt, computed=8)  # the same prompt's last chunk: positions 8 and 9
    kv = kv_with_tables({"M": [3, 7, 1], "E": [4, 9, 12]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(mid, 4), (last, 2)]), kv)

    assert inputs.input_ids.tolist() == [54, 55, 56, 57, 58, 59]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 8, 9]
    first, second = inputs.meta.prefills
    assert (first.token_start, first.num_tokens, first.num_cached) == (0, 4, 4)
    assert first.block_table.tolist() == [3, 7]          # blocks covering 8 tokens, not the third
    assert (second.token_start, second.num_tokens, second.num_cached) == (4, 2, 8)
    assert second.block_table.tolist() == [4, 9, 12]
    assert inputs.meta.slot_mapping.tolist() == [28, 29, 30, 31, 48, 49]
    assert inputs.logits_indices.tolist() == [5]      # only E caught up with its tokens
    assert inputs.meta.num_decode_tokens == 0 and inputs.meta.decode_block_tables is None


def test_a_recomputed_request_feeds_its_own_outputs_back() -> None:
    # Preempted after generating 70 and 71: the recompute chunk covers prompt and outputs alike.
    r = request("R", [1, 2, 3], outputs=(70, 71), computed=0)
    kv = kv_with_tables({"R": [5, 6]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(r, 5)]), kv)
    assert inputs.input_ids.tolist() == [1, 2, 3, 70, 71]
    assert inputs.logits_indices.tolist() == [4]


def test_forked_samples_read_their_parent_s_logits_row() -> None:
    # An n=3 request finishes its prompt beside a decode; its two new samples sample from the
    # parent's last prompt row. They come after the regular sampling requests.
    d = request("D", [1, 2], outputs=(3,), computed=2)
    parent = request("G", [40, 41, 42], n=3)
    kv = kv_with_tables({"D": [2], "G": [8]})
    children = [parent.fork(1), parent.fork(2)]
    for child in children:
        kv.fork("G", child.request_id)
    out = SchedulerOutput(scheduled=[(parent, 3), (d, 1)], forks=[(parent, c) for c in children])
    inputs = inputs_of(out, kv)

    # Rows: D's decode (0), then G's prompt (1-3). Sampling order: G, D, then the two children.
    assert inputs.input_ids.tolist() == [3, 40, 41, 42]
    assert inputs.logits_indices.tolist() == [3, 0, 3, 3]
    assert len(inputs.logits_indices) == len(out.sampling_requests())


def test_prompt_rows_are_the_rows_that_compute_prompt_tokens() -> None:
    # Rows: D decodes its output (generated), S verifies two speculative tokens after its output
    # (generated); then the chunks: L's one-row remainder is its prompt's last token (a chunk, not a
    # decode row: a prompt token computes as in its whole prompt), P's is all prompt, R recomputes
    # prompt then outputs after preemption.
    d = request("D", [1, 2, 3], outputs=(4,), computed=3)
    last = request("L", [5, 6, 7, 8, 9], computed=4)
    s = request("S", [1, 2], outputs=(3,), computed=2)
    s.spec_token_ids = [5, 6]
    p = request("P", [11, 12, 13, 14, 15])
    r = request("R", [1, 2, 3], outputs=(70, 71), computed=0)
    kv = kv_with_tables({"D": [1], "L": [2, 3], "S": [4, 9], "P": [5, 6], "R": [7, 8]})
    inputs = inputs_of(SchedulerOutput(scheduled=[(d, 1), (last, 1), (s, 3), (p, 5), (r, 5)]), kv)

    # Rows 0 D, 1-3 S, 4 L, 5-9 P, 10-14 R (its prompt's 3 then its 2 outputs).
    assert inputs.positions.tolist() == [3, 2, 3, 4, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert inputs.meta.num_decode_tokens == 4 and [c.num_tokens for c in inputs.meta.prefills] == [1, 5, 5]
    assert inputs.meta.prompt_rows == ((4, 13),)
    alone = inputs_of(SchedulerOutput(scheduled=[(d, 1)]), kv)
    assert alone.meta.prompt_rows == ()
