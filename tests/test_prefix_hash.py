"""shared.prefix_hash: the block-hash chain the API and every worker's engine must agree on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shared.prefix_hash import block_hash, chain, root_hash, to_hex

TOKENS = list(range(1000, 1037))  # 9 full blocks of 4 and one token over


def test_the_chain_has_one_hash_per_full_block_each_covering_all_before_it() -> None:
    hashes = chain(TOKENS, 4)
    assert len(hashes) == 9
    assert hashes[0] == block_hash(root_hash(), TOKENS[:4])
    assert hashes[1] == block_hash(hashes[0], TOKENS[4:8])
    changed_first = chain([0, *TOKENS[1:]], 4)
    assert all(a != b for a, b in zip(hashes, changed_first, strict=True))


def test_the_chain_continues_from_known_hashes() -> None:
    assert chain(TOKENS, 4, start=chain(TOKENS[:12], 4)) == chain(TOKENS, 4)


def test_tenants_and_adapters_root_apart() -> None:
    roots = {
        root_hash(),
        root_hash("acme"),
        root_hash("globex"),
        root_hash("acme", "lora-a"),
        root_hash(None, "lora-a"),
    }
    assert len(roots) == 5
    assert root_hash("") == root_hash(None)  # no tenant: one deployment-wide cache
    assert chain(TOKENS, 4, tenant="acme")[0] != chain(TOKENS, 4)[0]


def test_hex_is_16_digits() -> None:
    assert to_hex(1) == "0000000000000001" and len(to_hex(chain(TOKENS, 4)[0])) == 16


def test_the_chain_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "import json; from shared.prefix_hash import chain; "
        f"print(json.dumps(chain({TOKENS!r}, 4, tenant='acme', adapter='x')))"
    )
    seen = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.append(json.loads(out.stdout))
    assert seen[0] == seen[1] == chain(TOKENS, 4, tenant="acme", adapter="x")
