"""How many of a GGUF model's layers go to a GPU (--gpu-layers N|all|auto): the decision against
fake device lists (fits, does not fit, no device, a number of layers), the layout read from a
GGUF's tensors, the CPU's buffers for the layers left on it, and a CPU-only build that runs on
the CPU and says so (issue 58)."""

from __future__ import annotations

import pytest

from specdecode.backends.base import Placement
from specdecode.backends.llama_cpp import buffers
from specdecode.backends.llama_cpp.ggml_ctypes import GgufTensor
from specdecode.backends.llama_cpp.offload import (COMPUTE_RESERVE, Device, ModelLayout, layout_from_tensors,
                                                   offload_devices, plan_offload)
from specdecode.errors import SpecDecodeError
from specdecode.limits import check_gpu_layers
from specdecode.stats import placement_words

MiB, GiB = 1 << 20, 1 << 30
CPU = Device("CPU", "AMD EPYC 9R14", "cpu", 20 * GiB, 24 * GiB)
# A 1.5B model of 28 blocks: 32 MiB a block, a 260 MiB output layer, 28 KiB of KV a token in all.
LAYOUT = ModelLayout((32 * MiB,) * 28, 260 * MiB, 1024, trained_ctx=32768)


def gpu(free: int, name: str = "CUDA0", kind: str = "gpu") -> Device:
    return Device(name, "NVIDIA H100 80GB HBM3", kind, free, 80 * GiB)


def test_everything_fits_a_large_card():
    plan = plan_offload("auto", LAYOUT, [CPU, gpu(70 * GiB)], None)
    assert (plan.gpu_layers, plan.n_layers, plan.device) == (29, 29, "CUDA0")
    assert "all 29 layers on CUDA0 (NVIDIA H100 80GB HBM3)" in plan.note and "4096 tokens" in plan.note


def test_a_card_too_small_takes_as_many_layers_as_fit_and_says_why():
    need_all = LAYOUT.offloaded_bytes(29, 4096, 1.0)
    plan = plan_offload("auto", LAYOUT, [CPU, gpu(need_all - 200 * MiB)], None)
    assert 0 < plan.gpu_layers < 29
    assert LAYOUT.offloaded_bytes(plan.gpu_layers, 4096, 1.0) <= need_all - 200 * MiB
    assert LAYOUT.offloaded_bytes(plan.gpu_layers + 1, 4096, 1.0) > need_all - 200 * MiB  # the most that fit
    assert f"{plan.gpu_layers} of 29 layers on CUDA0" in plan.note and "the rest on the CPU" in plan.note
    assert "free" in plan.note and "--gpu-layers N" in plan.note


def test_the_kv_cache_of_the_context_asked_and_the_slots_count():
    free = LAYOUT.offloaded_bytes(29, 4096, 1.0) + 10 * MiB
    assert plan_offload("auto", LAYOUT, [CPU, gpu(free)], 4096).gpu_layers == 29
    assert plan_offload("auto", LAYOUT, [CPU, gpu(free)], 32768).gpu_layers < 29
    assert plan_offload("auto", LAYOUT, [CPU, gpu(free)], 4096, slots=8.0).gpu_layers < 29


def test_a_card_with_no_room_for_one_layer_leaves_the_model_on_the_cpu():
    plan = plan_offload("auto", LAYOUT, [CPU, gpu(COMPUTE_RESERVE // 2)], None)
    assert plan.gpu_layers == 0 and plan.device == "CPU" and "0 of 29 layers" in plan.note


def test_a_device_that_does_not_report_its_memory_gets_every_layer():
    assert plan_offload("auto", LAYOUT, [CPU, gpu(0)], None).gpu_layers == 29


@pytest.mark.parametrize("asked", ["auto", "all", 12, 0])
def test_a_cpu_only_build_runs_on_the_cpu(asked):
    plan = plan_offload(asked, LAYOUT, [CPU], None)
    assert plan.gpu_layers == 0 and plan.device == "CPU" and "CPU-only build" in plan.note
    assert ("cannot offload here" in plan.note) == (asked not in ("auto", 0))


@pytest.mark.parametrize("asked,layers", [(12, 12), (29, 29), (500, 29), ("all", 29), (0, 0)])
def test_a_number_of_layers_is_taken_as_asked_and_more_than_the_model_has_means_all(asked, layers):
    plan = plan_offload(asked, LAYOUT, [CPU, gpu(1 * MiB)], None)  # no room: asked for all the same
    assert plan.gpu_layers == layers and ("as asked" in plan.note)
    assert plan.device == ("CUDA0" if layers else "CPU")


def test_integrated_gpus_serve_only_where_no_discrete_one_is_there():
    igpu = gpu(8 * GiB, "Vulkan1", "igpu")
    assert [d.name for d in offload_devices([CPU, igpu])] == ["Vulkan1"]
    assert [d.name for d in offload_devices([CPU, igpu, gpu(8 * GiB)])] == ["CUDA0"]
    assert offload_devices([CPU, Device("BLAS", "", "accel", 0, 0)]) == []
    two = plan_offload("auto", LAYOUT, [CPU, gpu(40 * GiB), gpu(40 * GiB, "CUDA1")], None)
    assert two.devices == "CUDA0+CUDA1" and two.gpu_layers == 29


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("ALL", "all"), (" all ", "all"), ("12", 12), (0, 0),
                                            (99, 99)])
def test_gpu_layers_values(value, expected):
    assert check_gpu_layers(value, "--gpu-layers") == expected


@pytest.mark.parametrize("value", ["many", "-1", -1, 1.5, True, None, "12.5", 10**9])
def test_a_bad_gpu_layers_value_is_one_error_naming_it(value):
    with pytest.raises(SpecDecodeError) as e:
        check_gpu_layers(value, "--gpu-layers")
    assert "--gpu-layers" in str(e.value) and str(value) in str(e.value) and e.value.param == "--gpu-layers"


def test_the_layout_of_a_gguf_with_tied_embeddings_counts_the_embedding_as_its_output_layer():
    t = [GgufTensor("token_embd.weight", 12, (1536, 151936, 1, 1), 130 * MiB),
         GgufTensor("output_norm.weight", 0, (1536, 1, 1, 1), 6144)]
    for i in range(2):
        t += [GgufTensor(f"blk.{i}.attn_q.weight", 12, (1536, 1536, 1, 1), 2 * MiB),
              GgufTensor(f"blk.{i}.attn_k.weight", 12, (1536, 256, 1, 1), MiB // 4),
              GgufTensor(f"blk.{i}.attn_v.weight", 14, (1536, 256, 1, 1), MiB // 4),
              GgufTensor(f"blk.{i}.ffn_down.weight", 14, (8960, 1536, 1, 1), 9 * MiB)]
    layout = layout_from_tensors(t, {"{arch}.context_length": 32768})
    assert layout.block_bytes == (int(11.5 * MiB),) * 2 and layout.n_layers == 3
    assert layout.output_bytes == 130 * MiB + 6144 and layout.trained_ctx == 32768
    assert layout.kv_bytes_per_token == (256 + 256) * 2  # keys and values in f16
    untied = layout_from_tensors(t + [GgufTensor("output.weight", 14, (1536, 151936, 1, 1), 190 * MiB)], {})
    assert untied.output_bytes == 190 * MiB + 6144 and untied.trained_ctx == 0


def test_offloading_counts_the_output_layer_first_then_blocks_from_the_end():
    layout = ModelLayout((10, 20, 30), 100, 1)
    assert layout.offloaded_bytes(0, 8, 1.0) == 0
    assert layout.offloaded_bytes(1, 8, 1.0) == 100 + COMPUTE_RESERVE
    assert layout.offloaded_bytes(2, 8, 1.0) == 100 + 30 + 8 + COMPUTE_RESERVE
    assert layout.offloaded_bytes(9, 8, 2.0) == 100 + 60 + 3 * 16 + COMPUTE_RESERVE


def test_only_the_weights_left_on_the_cpu_are_placed_in_cpu_repack_by_name():
    tensors = [(f"blk.{i}.ffn_down.weight", 12, (1536, 8960, 1, 1)) for i in range(4)] + \
        [("output.weight", 12, (1536, 151936, 1, 1)), ("token_embd.weight", 12, (1536, 151936, 1, 1))]
    everything = buffers.repack_overrides(tensors, lambda *k: True)
    assert everything == [r"^blk\.(0|1|2|3)\.ffn_down\.weight$", r"^output\.weight$"]
    assert buffers.repack_overrides(tensors, lambda *k: True, cpu_blocks=2) == [r"^blk\.(0|1)\.ffn_down\.weight$"]
    assert buffers.repack_overrides(tensors, lambda *k: True, cpu_blocks=0) == []


def test_every_layer_on_a_gpu_asks_nothing_of_the_cpus_buffers(monkeypatch):
    def no_probe(*a, **k):
        raise AssertionError("no AMX probe where every layer is on a GPU")

    monkeypatch.setattr(buffers, "cached_probe", no_probe)
    monkeypatch.setattr(buffers, "amx_compiled", lambda: True)
    placed = buffers.resolve_buffers("model.gguf", 2, cpu_blocks=0)
    assert placed.choice == buffers.OFFLOADED and placed.use_extra_bufts and not placed.patterns


def test_placement_in_words_and_in_the_statistics():
    assert Placement().words() == "on the CPU" and Placement().on_cpu
    p = Placement("Vulkan0", 29, 29, "llvmpipe (LLVM 15.0.7, 256 bits)")
    assert p.words() == "all 29 layers on Vulkan0 (llvmpipe (LLVM 15.0.7, 256 bits))" and not p.on_cpu
    assert Placement("CUDA0", 12, 29).words() == "12 of 29 layers on CUDA0, the rest on the CPU"
    stats = {**p.to_dict(), "draft_models": [{"name": "qwen2.5-coder-0.5b-instruct", **Placement("Vulkan0", 25, 25).to_dict()}]}
    assert placement_words(stats) == ("target all 29 layers on Vulkan0; draft model qwen2.5-coder-0.5b-instruct all 25 "
                                      "layers on Vulkan0")
    assert placement_words({"device": "CPU", "gpu_layers": 0, "n_layers": 31}) == "target on the CPU"


def test_all_layers_asked_of_a_cpu_only_build_run_on_the_cpu_and_say_so(smollm_path, monkeypatch):
    from specdecode.backends.llama_cpp import LlamaCppBackend, backend
    from specdecode.backends.llama_cpp.offload import list_devices

    # The build's devices as a CPU-only build lists them (what CI's is; a GPU build's GPUs hidden).
    monkeypatch.setattr(backend, "list_devices", lambda: [d for d in list_devices() if d.kind == "cpu"])
    b = LlamaCppBackend(smollm_path, n_ctx=256, gpu_layers="all")
    try:
        assert b.placement.on_cpu and b.placement.gpu_layers == 0 and b.placement.n_layers == 31
        assert "CPU-only build" in b.offload_note and "--gpu-layers all cannot offload here" in b.offload_note
        assert b.device == "cpu" and "gpu_layers" not in b.cost_key  # the CPU's cost cache key, as before
        assert not b.weights_note.startswith("all")
        logits = b.forward([1, 2, 3], [2])
        assert logits.shape == (1, b.n_vocab)
    finally:
        b.close()
    with pytest.raises(SpecDecodeError, match="gpu_layers = 'lots'"):
        LlamaCppBackend(smollm_path, n_ctx=256, gpu_layers="lots")
