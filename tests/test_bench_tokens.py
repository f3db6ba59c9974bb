"""bench/token_peers.py's parts (the token workload against transformers' samplers) and a shortened
run of ``bench_tokens.py --part peers``, so the benchmark cannot rot between runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from extras import extra

extra("transformers", "hf")  # (the token peers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import token_peers as tp  # noqa: E402


def test_varlen_attention_is_each_sequence_s_own_causal_attention():
    torch.manual_seed(0)
    model = tp.build_lm()
    ds = tp.TokenSequences(np.array([5, 17, 2, 9]))
    packed, n = tp.loss_sum(model, tp.flatten([ds[i] for i in range(4)]))
    assert n == sum(len(ds[i]["input_ids"]) - 1 for i in range(4))  # labels[..., 1:] != -100
    model.config._attn_implementation = "sdpa"  # transformers' own, one sequence at a time
    alone = 0.0
    for i in range(4):
        ids = torch.tensor([ds[i]["input_ids"]])
        alone += float(model(input_ids=ids, labels=ids).loss.detach()) * (ids.shape[1] - 1)
    assert float(packed.detach()) == pytest.approx(alone, rel=1e-5)
    empty = tp.flatten([])
    assert empty["input_ids"].shape == (1, 0) and tp.work(empty["position_ids"]) == (0.0, 0.0)
    assert tp.work(tp.flatten([ds[0], ds[1]])["position_ids"]) == (4.0 + 16.0, 16.0 + 256.0)


@pytest.mark.parametrize("world", [2, 4])
def test_equal_tokens_hands_each_step_s_sequences_once_in_parts_of_about_equal_tokens(world):
    lens = np.random.default_rng(0).integers(16, 2048, 96)
    parts = [list(tp.EqualTokens(lens, 16, world, r, seed=3)) for r in range(world)]
    order = torch.randperm(96, generator=torch.Generator().manual_seed(3)).tolist()
    for s in range(6):
        step = [parts[r][s] for r in range(world)]
        assert all(step) and sum(step, []) == order[16 * s:16 * (s + 1)]  # contiguous, every rank some
        sums = np.concatenate([[0], np.cumsum(lens[order[16 * s:16 * (s + 1)]])])
        for k in range(1, world):  # each cut the one nearest k/world of the step's tokens
            goal = sums[-1] * k / world
            assert abs(sums[sum(len(p) for p in step[:k])] - goal) == np.abs(sums - goal).min()


def test_token_peers_bench_runs_shortened(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_tokens.py"), "--part", "peers",
           "--global-batch", "8", "--steps", "2", "--emulate", "model"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"^\| (hetlb[^|]*|BatchRebalanceSampler|default sampler|equal tokens per rank) \| "
                      r"([\d.]+) \| ([\d.]+) \(", out.stdout, re.M)
    assert [r[0] for r in rows[:5]] == list(tp.PEERS), out.stdout
    spread = re.search(r"any peer, any step: (\S+)$", out.stdout, re.M)
    assert spread and float(spread.group(1)) < 1e-5, out.stdout  # the same sequences each step, exactly weighted
