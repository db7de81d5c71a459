"""Red-team checks of what an SGLang page's key names: two deployments whose KV bytes for the
same tokens differ must never share a namespace, and one that changes nothing keeps its keys.

Each case is a setting SGLang runs with that changes the weights (hence every K/V byte) while
the served model name, the pool's geometry and dtype stay the same: a `--served-model-name`
alias over two checkpoints, `--revision`, `--load-format dummy`, online `--quantization`,
`--json-model-override-args`, a draft model's own quantization or load format, and an explicit
`--dtype` under an fp8 KV cache. Settings come from SGLang's real published runtime context
(`get_context().override_server_args`), pools are SGLang's real host pools on CPU, and the
linker's namespace (`_storage_config` + `DevicePageLayout`) must stay MaruStorage's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(60)]

import sglang_cpu  # noqa: E402

sglang_cpu.require()

import torch  # noqa: E402

from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from maru_sglang.pools import page_namespace, sidecar_namespace  # noqa: E402
from sglang_cpu.host_pools import (  # noqa: E402
    Geometry,
    expected_pages,
    fill,
    make_host_pool,
    page_indices,
    read,
    storage_config,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402

SERVED = "chat-model"  # one served name over every checkpoint below


@pytest.fixture(scope="module", autouse=True)
def published(tmp_path_factory):
    """What a scheduler process has: SGLang's ServerArgs published (the model bag read); the
    process's context as it was again after the module (later tests build pools outside a
    server, where nothing is published: a namespace left published here changed theirs)."""
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import SpawnRanks, get_model
    from sglang.srt.server_args import ServerArgs

    before = runtime_context.snapshot_context()
    try:
        get_model().model_path  # noqa: B018
    except (ValueError, AttributeError):
        from sglang_cpu.tiny_model import build_tiny_model

        model = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
        args = ServerArgs(model_path=str(model), device="cpu", page_size=4)
        runtime_context.publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    yield
    runtime_context.restore_context(before)


def _settings(**server_args):
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args(**server_args)


def _kv_namespace(g: Geometry | None = None, model: str = SERVED, **server_args) -> str:
    with _settings(**server_args):
        return page_namespace(storage_config(model=model), make_host_pool(g or Geometry()))


@pytest.mark.parametrize(
    "setting",
    [
        {"model_path": "/ckpt/finetuned"},  # an alias over another checkpoint
        {"revision": "v2"},
        {"load_format": "dummy"},  # random weights
        {"load_format": "bitsandbytes"},  # quantized while loading
        {"quantization": "fp8"},  # online quantization of a bf16 checkpoint
        {"json_model_override_args": '{"rope_scaling": {"type": "linear", "factor": 2.0}}'},
    ],
)
def test_a_setting_that_changes_the_weights_changes_the_kv_namespace(setting):
    base = _kv_namespace(model_path="/ckpt/base")
    assert _kv_namespace(**{"model_path": "/ckpt/base", **setting}) != base, setting


def test_settings_that_keep_the_bytes_keep_the_keys():
    """A deployment whose served name is its model path (the default) and a checkpoint load
    format that reads the same files keeps the namespace it had with no setting published."""
    from maru_sglang.pools import _weights_fields

    pool = make_host_pool(Geometry())
    for load_format in ("auto", "safetensors", "pt"):
        with _settings(model_path="/ckpt/base", load_format=load_format):
            assert _weights_fields(storage_config(model="/ckpt/base"), pool) == []
    # and two instances of one alias over one checkpoint still share pages
    assert _kv_namespace(model_path="/ckpt/a") == _kv_namespace(model_path="/ckpt/a")


def test_an_explicit_dtype_under_an_fp8_kv_cache_is_named():
    """fp8 pages of a model run in fp16 and in bf16 are as long (uint8 host pools): the
    activations cast into them differ."""
    g = Geometry(dtype=torch.float8_e4m3fn)
    common = dict(model_path="/ckpt/base", kv_cache_dtype="fp8_e4m3")
    bf16 = _kv_namespace(g, dtype="bfloat16", **common)
    assert _kv_namespace(g, dtype="float16", **common) != bf16
    assert _kv_namespace(g, dtype="auto", **common) != bf16


def test_a_draft_models_own_quantization_and_load_format_are_named():
    g = Geometry()
    spec = dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/ckpt/eagle")

    def draft(**more) -> str:
        with _settings(model_path="/ckpt/base", **spec, **more):
            pool = make_host_pool(g)
            return sidecar_namespace(storage_config(model=SERVED), "draft", pool, [1024], False)

    base = draft()
    assert draft(speculative_draft_model_quantization="fp8") != base
    assert draft(speculative_draft_load_format="dummy") != base
    assert draft(speculative_draft_load_format="safetensors") == base


def test_linker_and_maru_storage_agree_under_an_alias_and_a_revision():
    """The linker builds its storage config from ServerArgs, HiCache's controller from the
    served name (`storage_model_name`): the same namespace for one deployment, another for a
    second checkpoint served under the same name."""
    from sglang.srt.managers.cache_controller import storage_model_name
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from maru_sglang.linker import DevicePageLayout, _storage_config

    g = Geometry()
    device = MHATokenToKVPool(
        512, g.page_size, g.dtype, head_num=g.heads, head_dim=g.head_dim,
        layer_num=g.layers, device="cpu", enable_memory_saver=False,
        start_layer=0, end_layer=g.layers - 1,
    )  # fmt: skip
    layout = DevicePageLayout(device, g.page_size)
    params = SimpleNamespace(pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
    seen = set()
    for path, served in (("/ckpt/a", SERVED), ("/ckpt/b", SERVED), ("/ckpt/a", None)):
        settings = dict(model_path=path, revision="r1")
        with _settings(**settings):
            server_args = SimpleNamespace(served_model_name=served, model_path=path)
            linker_ns = page_namespace(_storage_config(server_args, params, False), layout.geometry)
            host = make_host_pool(g)
            name = storage_model_name(served or path, host)
            storage_ns = page_namespace(storage_config(model=name), host)
        assert linker_ns == storage_ns, (path, served)
        seen.add(storage_ns)
    assert len(seen) == 3


def test_an_alias_over_another_checkpoint_misses_the_pages_written(maru_server):
    """Bytes: a finetune served under the base model's name reads none of the base's pages;
    another instance of the base reads them back exactly."""
    extra = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    g = Geometry()
    keys = [f"alias-{i}" for i in range(3)]
    idx = page_indices(0, 3, g.page_size)
    dst = page_indices(4, 3, g.page_size)

    def instance(path: str) -> MaruStorage:
        with _settings(model_path=path):
            s = MaruStorage(storage_config(model=SERVED, extra=extra), {})
            s.register_mem_pool_host(make_host_pool(g))
        return s

    writer = instance("/ckpt/base")
    pages = expected_pages(writer.mem_pool_host, 3, seed=11)
    fill(writer.mem_pool_host, idx, pages)
    assert writer.batch_set_v1(keys, idx) == [True] * 3
    writer.confirm_writes()
    finetune, same = instance("/ckpt/finetuned"), instance("/ckpt/base")
    try:
        assert finetune.batch_exists(keys) == 0
        assert finetune.batch_get_v1(keys, dst) == [False] * 3
        assert same.batch_get_v1(keys, dst) == [True] * 3
        assert all(torch.equal(x, y) for x, y in zip(read(same.mem_pool_host, dst, 3), pages))
    finally:
        for s in (finetune, same, writer):
            s.close()


def _weight_version(version: str) -> None:
    """What SGLang's scheduler does when a weight update names a version
    (`Scheduler.record_weight_version_change`): the published setting changes in place."""
    from sglang.srt.runtime_context import get_context

    get_context().override("scheduler.weight_version", weight_version=version)


def test_a_weight_update_that_names_a_version_rekeys_the_pages(maru_server):
    """An RL loop updates the weights in place and names the new version: the pages the old
    weights computed are misses for this instance from its next call on (before: 3 of 3 hits,
    the old weights' KV for the new model; mutation: no `_follow_weights` in `_require_pool`),
    its new pages are read by an instance on the new version, and an instance back on the old
    version still reads the old pages, exactly."""
    from sglang.srt.runtime_context import get_serving

    extra = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    g = Geometry()
    keys = [f"rl-{i}" for i in range(3)]
    idx, dst = page_indices(0, 3, g.page_size), page_indices(4, 3, g.page_size)
    before = get_serving().weight_version
    assert before == "default"

    def instance() -> MaruStorage:
        s = MaruStorage(storage_config(model=SERVED, extra=extra), {})
        s.register_mem_pool_host(make_host_pool(g))
        return s

    writer = instance()
    old = expected_pages(writer.mem_pool_host, 3, seed=21)
    fill(writer.mem_pool_host, idx, old)
    assert writer.batch_set_v1(keys, idx) == [True] * 3
    writer.confirm_writes()
    assert writer.batch_exists(keys) == 3
    old_namespace = writer.namespace
    try:
        _weight_version("rl-step-1")
        assert writer.batch_exists(keys) == 0
        assert writer.batch_get_v1(keys, dst) == [False] * 3
        assert writer.namespace != old_namespace
        new = expected_pages(writer.mem_pool_host, 3, seed=22)
        fill(writer.mem_pool_host, idx, new)
        assert writer.batch_set_v1(keys, idx) == [True] * 3
        writer.confirm_writes()
        reader = instance()  # built on the new version
        try:
            assert reader.namespace == writer.namespace
            assert reader.batch_get_v1(keys, dst) == [True] * 3
            assert all(torch.equal(x, y) for x, y in zip(read(reader.mem_pool_host, dst, 3), new))
        finally:
            reader.close()
    finally:
        _weight_version(before)
    try:  # back on the old weights: their pages, not the new ones
        assert writer.batch_get_v1(keys, dst) == [True] * 3
        assert writer.namespace == old_namespace
        assert all(torch.equal(x, y) for x, y in zip(read(writer.mem_pool_host, dst, 3), old))
    finally:
        writer.close()
