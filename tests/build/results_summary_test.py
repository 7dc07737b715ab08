"""bench/results/SUMMARY.md is what bench/summarize_results.py makes of the result files beside
it: regenerated in memory here, it must equal the committed one, and every result file must
appear in it."""

import json

import pytest

from bench import gpu_trace, summarize_results

RESULTS = summarize_results.RESULTS


def test_the_committed_summary_is_what_the_result_files_give():
    committed = (RESULTS / summarize_results.SUMMARY).read_text()
    assert committed == summarize_results.summarize(RESULTS), (
        "bench/results/SUMMARY.md is out of date: run `python bench/summarize_results.py` and "
        "commit what it writes")


def test_every_result_file_appears_in_the_summary():
    text = summarize_results.summarize(RESULTS)
    files = [p.name for p in RESULTS.iterdir() if p.name != summarize_results.SUMMARY]
    # One current file per benchmark and GPU kind (one, two and four GPUs lent).
    assert len(files) <= 48, f"bench/results holds {len(files)} files; keep one per benchmark and GPU"
    assert [name for name in files if f"`{name}`" not in text] == []
    assert "## Other files" not in text, "a result file of a kind the summary does not read"


def _serving_file(tp, time_ms, busy_us):
    row = {"op": "serving_decode", "impl": "xla_ext_torchax", "scheduling": "async",
           "batch": 1, "shape": "B=1,context=2048", "time_per_step_ms": time_ms,
           "tokens_per_s": 1000 / time_ms, "gpu_ms_per_step": busy_us[0] / 1000, "floor_ms": 1.0}
    devices = {str(i): {"span_us": 9000.0, "busy_us": b, "collective_us": 100.0, "idle_us": 0.0}
               for i, b in enumerate(busy_us)} if len(busy_us) > 1 else None
    return {"model": "8b", "dtype": "bfloat16", "device": "cpu", "context": 2048,
            "tensor_parallel_size": tp, "rows": [row],
            "profiles": {"decode B=1,context=2048 async": {"per_device": devices}}}


def test_tensor_parallel_rows_are_set_against_tp1_of_the_same_model_and_step(tmp_path):
    (tmp_path / "h100x2-serving-8b-tp1.json").write_text(json.dumps(_serving_file(1, 8.0, [8000.0])))
    (tmp_path / "h100x2-serving-8b-tp2.json").write_text(
        json.dumps(_serving_file(2, 5.0, [4500.0, 4400.0])))
    text = summarize_results.summarize(tmp_path)
    assert "(2 x H100; bfloat16, context 2048)" in text
    assert "| 8b | 1 | B=1,context=2048 | async | 8.00 | 125 | 8.00 | – | 1.00 | – |" in text
    assert "| 8b | 2 | B=1,context=2048 | async | 5.00 | 200 | 4.50 / 4.40 | 0.10 / 0.10 | 1.00 " \
           "| 0.62 |" in text


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("all_reduce_1_0_fusion_1", "collectives"),
    ("void xla_ext::attention::decode::tensor_core::AttendTensorCoreKernel<__nv_bfloat16, 64>",
     "attention"),
    ("void xla_ext::kv_cache_update::(anonymous namespace)::WriteSlotsKernel<uint4>", "attention"),
    ("gemm_fusion_dot_general_262", "GEMMs"),
    ("void xla_ext::small_batch_linear::(anonymous namespace)::SmallBatchLinearKernel<"
     "__nv_bfloat16, 1, 2, true, true>(xla_ext::small_batch_linear::(anonymous namespace)::"
     "Params)", "GEMMs"),
    ("nvjet_sm90_tss_224x64_64x5_2x1_v_bz_TNN", "GEMMs"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("loop_add_fusion_16", "other"),
    ("input_concatenate_fusion_31", "other"),
])
def test_kernels_are_told_apart_by_name(name, kind):
    assert gpu_trace.kernel_kind(name) == kind


def test_kernel_time_by_kind_appears_for_profiles_that_have_it(tmp_path):
    kinds = {"GEMMs": 820.0, "attention": 402.5, "other": 208.0, "copies": 3.0}
    one_gpu = _serving_file(1, 1.55, [1560.0])
    one_gpu["profiles"]["decode B=1,context=2048 async"]["kernel_kinds_us"] = kinds
    one_gpu["copy_gbps"] = 3000.0
    (tmp_path / "h100-serving.json").write_text(json.dumps(one_gpu))
    split = _serving_file(2, 5.0, [4500.0, 4400.0])
    split["profiles"]["decode B=1,context=2048 async"]["kernel_kinds_us"] = dict(
        kinds, collectives=470.0)
    (tmp_path / "h100x2-serving-8b-tp2.json").write_text(json.dumps(split))
    text = summarize_results.summarize(tmp_path)
    assert "| profile | GEMMs | attention | collectives | other |" in text
    assert "| decode B=1,context=2048 async | 0.82 | 0.40 | 0.00 | 0.21 |" in text
    assert "| 8b TP=2 decode B=1,context=2048 async | 0.82 | 0.40 | 0.47 | 0.21 |" in text


def test_a_file_of_an_unknown_kind_is_listed_unread(tmp_path):
    (tmp_path / "h100-something-new.json").write_text("{}")
    text = summarize_results.summarize(tmp_path)
    assert "## Other files (no summary for their kind)\n\n- `h100-something-new.json`" in text


@pytest.mark.parametrize("content, expected", [
    ("{not json", "expected a JSON results file, got invalid JSON"),
    ('{"copy_gbps": 3000}', "expected the fields of a 'Ragged paged attention' result file"),
])
def test_a_broken_result_file_is_named(tmp_path, content, expected):
    (tmp_path / "h100-ragged.json").write_text(content)
    with pytest.raises(ValueError, match=expected) as error:
        summarize_results.summarize(tmp_path)
    assert "h100-ragged.json" in str(error.value)


def test_the_results_argument_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="results: expected a folder of result files, got "):
        summarize_results.summarize(tmp_path / "missing")
