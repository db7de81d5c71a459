"""Red-team tests of what `maru_vllm`'s keys bind: inputs to a block's KV bytes outside the
model's identity (path, revision, architecture config), which two instances of one model may
set differently.

* LongRoPE (Phi-3 and kin): vLLM 0.33's `Phi3LongRoPEScaledRotaryEmbedding` rotates keys
  with its long factors at *every* position iff `max_model_len` exceeds the config's
  `original_max_position_embeddings`; an instance started with a shorter `--max-model-len`
  computes other keys for the same tokens. Before: the same key, so one loaded the other's.
* The weights' source: `--load-format dummy` (random weights) or `tensorizer` (weights from
  a file named in the loader's extra config), or `--model-weights` (weights from elsewhere
  than the `model` directory of config files), all under the same model path.
* Llama 4: vLLM turns on `attn_temperature_tuning` (its NoPE layers' queries scaled past
  8K positions, so the later layers' KV differs) where `max_model_len` exceeds 32K.
* A custom pipeline split (`VLLM_PP_LAYER_PARTITION`): with 3 stages, stage 1 of "2,3,3"
  and of "3,3,2" hold as many layers (same value size), other ones.

vLLM's real `ModelConfig`, `get_rope` and connector factory run in spawned processes (vLLM
on their path, tests/vllm_cpu); the end-to-end test uses a real maru-server.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from vllm_cpu import fixtures

from .workers import run_processes

pytestmark = pytest.mark.vllm
fixtures.require()

from vllm_cpu import workers as W  # noqa: E402

model_dir = fixtures.model_dir  # (a shared fixture: a tiny model)

DEADLINE = 50
BLOCK = 16
# a LongRoPE model (head size 16: 8 factors); its short context is 2048 tokens
LONGROPE = {
    "max_position_embeddings": 8192,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": 2048,
    },
}


@pytest.fixture
def vllm_env(monkeypatch):
    """vLLM's environment (`set_vllm_env`), without a pipeline split from the outer one: the
    pipeline cases set their own `VLLM_PP_LAYER_PARTITION`."""
    fixtures.set_vllm_env(monkeypatch)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


def _config(model_dir: str, url: str, case: dict[str, Any]) -> Any:
    """The tests' `VllmConfig` (tests/vllm_cpu) with `case`: `max_model_len`, `longrope`
    (LongRoPE's `hf_overrides`), `llama4_len`, `load_format`, `loader_extra`,
    `model_weights`, `pp`."""
    from vllm.config import ModelConfig

    from vllm_cpu.engine import vllm_config

    config = vllm_config(model_dir, url, pp=case.get("pp", 1))
    config.model_config = ModelConfig(
        model=model_dir,
        dtype="float16",
        seed=0,
        max_model_len=case.get("max_model_len", 2048),
        hf_overrides=LONGROPE if case.get("longrope") else {},
        model_weights=case.get("model_weights", ""),
    )
    if "llama4_len" in case:  # (a stand-in: the tiny model named Llama 4, a longer context)
        config.model_config.hf_config.architectures = ["Llama4ForCausalLM"]
        config.model_config.max_model_len = case["llama4_len"]
    config.load_config.load_format = case.get("load_format", "auto")
    config.load_config.model_loader_extra_config = case.get("loader_extra", {})
    return config


def _namespaces(model_dir: str, cases: list[dict[str, Any]]) -> dict:
    """Each case's `kv_namespace` (`partition`: `VLLM_PP_LAYER_PARTITION` for it), and, for
    a LongRoPE case, the key vLLM's rotary embedding gives position 1 of a fixed head."""
    W._vllm_on_path()
    import torch
    import vllm.model_executor.layers.rotary_embedding as rotary
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from maru_vllm.keys import kv_namespace
    from vllm_cpu.engine import kv_cache_config

    out: dict[str, list] = {"namespace": [], "rotated_key": []}
    head = torch.linspace(-1.0, 1.0, 16).repeat(2, 1)  # positions 0 and 1, one head
    for case in cases:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        if "partition" in case:
            os.environ["VLLM_PP_LAYER_PARTITION"] = case["partition"]
        config = _config(model_dir, "tcp://127.0.0.1:1", case)
        ns = kv_namespace(config, kv_cache_config(8), [0], BLOCK, KVCacheLayout.LBNHC)
        out["namespace"].append(ns)
        key = None
        if case.get("longrope"):
            rotary._ROPE_DICT.clear()  # (vLLM caches rotary embeddings by their parameters)
            params = config.model_config.hf_text_config.rope_parameters
            with set_current_vllm_config(config):
                rope = rotary.get_rope(16, 8192, rope_parameters=params, dtype=torch.float32)
            _, rotated = rope.forward(torch.arange(2), head.clone(), head.clone())
            key = rotated[1].tolist()
        out["rotated_key"].append(key)
    return out


def _namespaces_of(model_dir: str, cases: list[dict[str, Any]]) -> dict:
    (r,) = run_processes([(_namespaces, (model_dir, cases))], DEADLINE)
    assert "error" not in r, r.get("error")
    return r


def test_longrope_keys_name_the_factors_max_model_len_selects(model_dir, vllm_env):
    """vLLM's LongRoPE embedding rotates position 1's key differently with `max_model_len`
    4096 (long factors) than with 2048 (short: the config's original 2048): their keys must
    differ. 1024 and 2048 (both short) give the same bytes and share keys, as every model
    without LongRoPE keeps one key whatever its `max_model_len`. Mutation: without
    `_long_rope` in `kv_namespace`, 2048 and 4096 share a namespace."""
    r = _namespaces_of(
        model_dir,
        [
            {"longrope": True, "max_model_len": 1024},
            {"longrope": True, "max_model_len": 2048},
            {"longrope": True, "max_model_len": 4096},
            {"max_model_len": 1024},
            {"max_model_len": 2048},
        ],
    )
    short, short2, long, plain, plain2 = r["namespace"]
    keys = r["rotated_key"]
    assert keys[0] == keys[1] and keys[1] != keys[2]  # the bytes: same, then other
    assert short == short2 and short != long
    assert plain == plain2


def test_weights_from_elsewhere_than_the_checkpoint_are_in_the_key(model_dir, vllm_env):
    """Random (`dummy`) weights, a tensorizer file and `--model-weights` each compute other
    KV than the checkpoint at the model path: none shares the checkpoint's namespace, nor
    two tensorizer files each other's. Loaders that read the checkpoint (`safetensors`,
    `pt`) keep the default's keys. Mutation: without `_other_inputs`/`weights`, all equal."""
    r = _namespaces_of(
        model_dir,
        [
            {},
            {"load_format": "safetensors"},
            {"load_format": "pt"},
            {"load_format": "dummy"},
            {"load_format": "tensorizer", "loader_extra": {"tensorizer_uri": "/m/a.tensors"}},
            {"load_format": "tensorizer", "loader_extra": {"tensorizer_uri": "/m/b.tensors"}},
            {"model_weights": "/elsewhere/weights"},
        ],
    )
    auto, safetensors, pt, dummy, tensor_a, tensor_b, weights = r["namespace"]
    assert auto == safetensors == pt
    assert len({auto, dummy, tensor_a, tensor_b, weights}) == 5


def test_llama4_keys_name_its_query_temperature(model_dir, vllm_env):
    """Llama 4 (its name on the tiny model: `_llama4_temperature` reads only the names, the
    generation config and `max_model_len`) tunes its query temperature above a
    `max_model_len` of 32K: 16K and 32K share keys, 64K does not. Mutation: without
    `attn_temperature_tuning` in `_other_inputs`, all three are equal."""
    r = _namespaces_of(model_dir, [{"llama4_len": n} for n in (16384, 32768, 65536)])
    a, b, c = r["namespace"]
    assert a == b and b != c


def test_a_custom_pipeline_split_is_in_the_key(model_dir, vllm_env):
    """Three stages: stage 1 of "2,3,3" holds layers 2-4, of "3,3,2" layers 3-5 (the same
    value size, other bytes): the splits must not share keys, nor with vLLM's default split.
    One stage ignores the variable (it holds every layer). Mutation: without the split in
    `_other_inputs`, all three 3-stage namespaces are equal."""
    r = _namespaces_of(
        model_dir,
        [
            {"pp": 3},
            {"pp": 3, "partition": "2,3,3"},
            {"pp": 3, "partition": "3,3,2"},
            {"pp": 1},
            {"pp": 1, "partition": "4"},
        ],
    )
    default, split_a, split_b, one, one_set = r["namespace"]
    assert len({default, split_a, split_b}) == 3
    assert one == one_set


def _longrope_matches(model_dir: str, url: str, readers: list[int]) -> dict:
    """Instance A (LongRoPE, `max_model_len` 4096: long factors) computes and saves prompt
    0; then a scheduler-side connector of each reader's `max_model_len` says how many tokens
    of prompt 0 Maru holds for it."""
    from vllm_cpu.matching import saved_then_matched

    def writer(config: Any) -> None:  # (the connectors anew, with A's model config)
        longrope = _config(model_dir, url, {"longrope": True, "max_model_len": 4096})
        config.model_config = longrope.model_config

    return saved_then_matched(
        model_dir,
        url,
        writer,
        (_config(model_dir, url, {"longrope": True, "max_model_len": n}) for n in readers),
    )


def test_a_longrope_instance_of_a_shorter_max_model_len_never_hits_its_blocks(
    maru_server_factory, model_dir, vllm_env
):
    """A (LongRoPE, `max_model_len` 4096) saves prompt 0's 5 full blocks. A reader of the
    same model with `max_model_len` 2048 rotates keys with the short factors: it finds none
    of A's blocks; a reader with 4096 finds all 5. Mutation: without `_long_rope`, the 2048
    reader matches all 5 and would load keys rotated by factors it does not use."""
    server = maru_server_factory(pool_size="256M")
    (r,) = run_processes([(_longrope_matches, (model_dir, server.url, [2048, 4096]))], DEADLINE)
    assert "error" not in r, r.get("error")
    assert r["saved"] == W.BLOCKS
    assert r["matched"] == [0, W.BLOCKS * BLOCK]
