"""Fidelity data, model configs, workload specs and engine files on hostile input (probe A, 1-4 and 6): a repeated
model row, senseless recorded values, misspelt workload keys, heads that do not divide the hidden size, stages
beyond any span, a byte-order mark and YAML's text-for-a-number, each a clean error (exit 3) that names the file,
the row or key and the fix, never a silent result."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from servelens.cli import cli

RUN = "60"  # a measured run of the shared fidelity data: Llama-3.1-70B-Instruct tp4, general-lite


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env or {}, catch_exceptions=False)


def _folder(tmp_path: Path, shared: Path, change=None, *, models: str | None = None,
            workload: dict | None = None) -> Path:
    """A fidelity folder of the shared data's run 60 alone: ``change`` edits its experiments.csv row, ``models``
    replaces models.csv, ``workload`` the general-lite spec."""
    source = shared / "fidelity"
    folder = tmp_path / "fd"
    (folder / "workloads").mkdir(parents=True)
    with (source / "experiments.csv").open(newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if r["id"] == RUN]
        columns = reader.fieldnames
    if change is not None:
        change(rows[0])
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    (folder / "experiments.csv").write_text(text.getvalue())
    (folder / "models.csv").write_text(models if models is not None else (source / "models.csv").read_text())
    spec = folder / "workloads" / "general-lite.yaml"
    if workload is None:
        shutil.copy(source / "workloads" / "general-lite.yaml", spec)
    else:
        spec.write_text(yaml.safe_dump(workload))
    return folder


def _fidelity(tmp_path: Path, folder: Path):
    return _run("fidelity", "--data", str(folder), "--out", str(tmp_path / "out"))


def _general_lite(shared: Path) -> dict:
    return yaml.safe_load((shared / "fidelity" / "workloads" / "general-lite.yaml").read_text())


# -- 1: a model given twice in models.csv ---------------------------------------------------------------------------


def test_a_model_given_twice_in_the_model_table_is_refused_naming_both_lines(tmp_path, shared):
    table = (shared / "fidelity" / "models.csv").read_text()
    line = next(row for row in table.splitlines() if row.startswith("meta-llama/Llama-3.1-70B-Instruct,"))
    folder = _folder(tmp_path, shared, models=table + line.replace(",80,", ",8,", 1) + "\n")  # 8 layers, not 80
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3, done.output
    first = table.splitlines().index(line) + 1
    last = len(table.splitlines()) + 1
    assert (f"{folder / 'models.csv'} line {last}: model 'meta-llama/Llama-3.1-70B-Instruct' is given twice "
            f"(also line {first})") in done.output
    assert "hint: keep one of the two rows" in done.output
    assert not (tmp_path / "out").exists()


def test_a_model_given_twice_in_another_case_is_refused_too(tmp_path, shared):
    table = (shared / "fidelity" / "models.csv").read_text()
    line = next(row for row in table.splitlines() if row.startswith("01-ai/Yi-34B,"))
    folder = _folder(tmp_path, shared, models=table + line.replace("01-ai/Yi-34B", "01-AI/yi-34b") + "\n")
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3 and "model '01-AI/yi-34b' is given twice (also line 2)" in done.output


# -- 2: recorded values no run can have ------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", ["0.5", "0.001", "0"])
def test_fewer_than_one_counted_output_token_is_refused(tmp_path, shared, tokens):
    folder = _folder(tmp_path, shared, lambda row: row.update(derived_mean_output_tokens=tokens))
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3, done.output
    assert (f"error: {folder / 'experiments.csv'} row {RUN}: derived_mean_output_tokens {float(tokens)} is not a "
            "mean output length") in done.output
    assert "hint: a response the client timed has at least one token" in done.output


@pytest.mark.parametrize("tokens", ["1e12", "300"])
def test_more_counted_output_tokens_than_the_spec_generates_is_refused(tmp_path, shared, tokens):
    folder = _folder(tmp_path, shared, lambda row: row.update(derived_mean_output_tokens=tokens))
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3, done.output
    assert (f"row {RUN}: derived_mean_output_tokens {float(tokens):g} is more than the 248 output tokens its workload "
            f"{folder / 'workloads' / 'general-lite.yaml'} asks for (output_len)") in done.output
    assert "hint: give the mean output tokens the client counted (at most 248)" in done.output


def test_the_shared_runs_counted_lengths_stay_within_the_tolerance(shared):
    """Run 65 counts 248.2 tokens of 248 generated: re-tokenized text, within COUNTED_OUTPUT_TOLERANCE."""
    from replay.fidelity import COUNTED_OUTPUT_TOLERANCE, output_count_ratio, read_experiments

    ratios = {e.id: output_count_ratio(e) for e in read_experiments(shared / "fidelity")}
    assert 1 < ratios["65"] < 1 + COUNTED_OUTPUT_TOLERANCE and all(r > 0.7 for r in ratios.values())


@pytest.mark.parametrize("stat", ["mean", "p90", "p99"])
def test_an_e2e_below_the_ttft_is_refused_naming_the_run_and_columns(tmp_path, shared, stat):
    folder = _folder(tmp_path, shared, lambda row: row.update({f"e2e_{stat}_ms": "1", f"ttft_{stat}_ms": "5000"}))
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3, done.output
    assert (f"error: {folder / 'experiments.csv'} row {RUN}: e2e_{stat}_ms 1 is below ttft_{stat}_ms 5000, but a "
            "response's last byte comes no sooner than its first") in done.output
    assert f"hint: check the two columns (swapped, or in other units?): E2E {stat} is at least TTFT {stat}" in done.output


def test_an_experiments_table_with_a_byte_order_mark_is_read(tmp_path, shared):
    """A spreadsheet's UTF-8 export starts with a byte-order mark: the header is read through it (here to the cell
    the row gets wrong; the mark used to hide the 'id' column)."""
    folder = _folder(tmp_path, shared, lambda row: row.update(derived_mean_output_tokens="0.5"))
    path = folder / "experiments.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3, done.output
    assert "no column 'id'" not in done.output
    assert f"row {RUN}: derived_mean_output_tokens 0.5 is not a mean output length" in done.output


# -- 3: misspelt workload keys --------------------------------------------------------------------------------------


def test_misspelt_workload_keys_are_refused_with_the_keys_they_are_closest_to(tmp_path, shared):
    spec = _general_lite(shared)
    spec["data"]["system_promt_len"] = 5000
    spec["data"]["enable_multi_turn_chatt"] = spec["data"].pop("enable_multi_turn_chat")
    spec["load"]["typo_type"] = "constant"
    folder = _folder(tmp_path, shared, workload=spec)
    done = _fidelity(tmp_path, folder)
    assert done.exit_code == 3, done.output
    assert (f"row {RUN} (profile 'general-lite'): {folder / 'workloads' / 'general-lite.yaml'}: unknown keys "
            "load.typo_type, data.") in done.output  # every unknown key at once, the load's first
    assert "data.system_promt_len (did you mean data.system_prompt_len?)" in done.output
    assert "data.enable_multi_turn_chatt (did you mean data.enable_multi_turn_chat?)" in done.output
    assert "hint: load takes type, interval, stages," in done.output
    assert "data takes type, path," in done.output and "enable_multi_turn_chat" in done.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(apii={"type": "chat"}), "unknown key apii"),
        (lambda s: s["load"]["stages"][1].update(rat=3), "unknown key load.stages[1].rat (did you mean load.stages[1].rate?)"),
        (lambda s: s["load"].update(sweep={"type": "linear"}),
         "load.sweep is set, but the replay does not model stages generated up to the server's saturation rate"),
        (lambda s: s["data"].update(multimodal={"image": {"count": 1}}),
         "data.multimodal is set, but the replay does not model images, video or audio attached to the prompts"),
        (lambda s: s["data"].update(question_len={"mean": 400, "std_dev": 10, "typ": "lognormal"}),
         "unknown key question_len.typ (did you mean question_len.type?)"),
        (lambda s: s["data"].update(question_len={"mean": 400, "type": "lognormal", "distribution": "normal"}),
         "question_len gives type 'lognormal' and distribution 'normal'"),
    ],
)
def test_other_unknown_or_unmodelled_workload_keys_are_refused(tmp_path, shared, edit, message):
    spec = _general_lite(shared)
    edit(spec)
    done = _fidelity(tmp_path, _folder(tmp_path, shared, workload=spec))
    assert done.exit_code == 3, done.output
    assert message in done.output and "hint: " in done.output


def test_every_shared_workload_and_inference_perfs_own_keys_still_read(shared):
    """The fidelity transcriptions (with their documentation keys) and a config in inference-perf's own layout,
    with its server, tokenizer, report and worker-pool keys and an inline distribution by inference-perf's names."""
    from replay.inference_perf import parse_inference_perf, read_inference_perf

    for path in sorted((shared / "fidelity" / "workloads").glob("*.yaml")):
        assert read_inference_perf(path).num_requests > 0
    doc = {
        "load": {"type": "constant", "interval": 15, "num_workers": 4, "worker_max_concurrency": 100,
                 "base_seed": 7, "stages": [{"rate": 1, "duration": 30}]},
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": "m", "base_url": "http://0.0.0.0:8000", "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": "m"},
        "report": {"request_lifecycle": {"summary": True}},
        "storage": {"local_storage": {"path": "reports"}},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "seed": 42, "num_unique_system_prompts": 10, "num_users_per_system_prompt": 10, "system_prompt_len": 100,
            "question_len": {"type": "skew_normal", "mean": 200, "std_dev": 80, "skew": 2.5, "min": 10, "max": 2000},
            "output_len": {"type": "lognormal", "mean": 150, "variance": 3600, "min": 1, "max": 4096}}},
    }
    spec = parse_inference_perf(doc)
    assert spec.question_tokens.distribution == "skew_normal"  # inference-perf's `type`, once silently normal
    assert (spec.output_tokens.distribution, spec.output_tokens.std) == ("lognormal", 60.0)


# -- 4: a config.json whose heads do not divide its hidden size, and files that are no object ------------------------


def _replay_engine(tmp_path: Path, engine: str):
    return _run("replay", "--workload", "azure-conv", "--requests", "5", "--engine", engine, "--out",
                str(tmp_path / "run"))


@pytest.mark.parametrize(("hidden", "heads"), [(4096, 3), (16, 32)])
def test_a_config_json_whose_heads_do_not_divide_its_hidden_size_is_refused(tmp_path, hidden, heads):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": hidden, "num_attention_heads": heads,
                                  "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 100}))
    done = _replay_engine(tmp_path, f"{config}@h100")
    assert done.exit_code == 3, done.output
    assert (f"error: {config}: field 'num_attention_heads' ({heads}) does not divide 'hidden_size' ({hidden}), and no "
            "'head_dim' gives each head's width") in done.output
    assert "hint: fix num_attention_heads or hidden_size, or give head_dim" in done.output
    assert "'head_dim' must be a positive whole number" not in done.output


def test_a_config_json_with_an_explicit_head_dim_needs_no_dividing_heads(tmp_path):
    from replay.catalog import read_hf_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 5120, "num_attention_heads": 3,
                                  "num_key_value_heads": 1, "head_dim": 128, "intermediate_size": 64,
                                  "vocab_size": 100}))
    assert read_hf_config(config).head_dim == 128


@pytest.mark.parametrize(("text", "message"), [
    ("[]", "not a config.json (the top level is a JSON array, not an object)"),
    ("", "is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"num_hidden_layers": ' + "9" * 5001 + "}", "holds a number of more than 4,300 digits"),
])
def test_a_config_json_that_is_not_an_object_says_how_to_fix_it(tmp_path, text, message):
    config = tmp_path / "config.json"
    config.write_text(text)
    done = _replay_engine(tmp_path, f"{config}@h100")
    assert done.exit_code == 3, done.output
    assert message in done.output
    assert "hint: give the model's config.json as Hugging Face publishes it: a JSON object of its fields" in done.output
    assert "internal error" not in done.output


def test_a_generation_config_that_is_not_an_object_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 64,
        "vocab_size": 100}))
    (tmp_path / "generation_config.json").write_text("[1]")
    done = _replay_engine(tmp_path, f"{tmp_path / 'config.json'}@h100")
    assert done.exit_code == 3, done.output
    assert (f"{tmp_path / 'generation_config.json'}: not a generation_config.json (the top level is a JSON array, "
            "not an object)") in done.output
    assert "repetition_penalty" not in done.output and "hint: fix the file" in done.output


# -- 6: stages beyond any span, and YAML's text for a number ----------------------------------------------------------


@pytest.mark.parametrize(("stage", "message"), [
    ({"rate": 1e-300, "duration": 1e300},
     "load.stages[0].duration 1e+300 s is more than 1e+09 s (about 31 years), the longest a replayed workload may span"),
    ({"rate": 5e-324, "duration": 100}, "load.stages[0].rate 4.94066e-324 requests/s is below 1e-09"),
])
def test_a_stage_beyond_any_span_is_a_clean_error(tmp_path, shared, stage, message):
    spec = _general_lite(shared)
    spec["load"]["stages"] = [stage]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = _run("replay", "--workload", str(path), "--engine", "llama-3-8b@h100", "--out", str(tmp_path / "run"))
    assert done.exit_code == 3, done.output
    assert f"error: {path}: {message}" in done.output
    assert "RuntimeWarning" not in done.output and "converter wrote them wrong" not in done.output


def test_stages_that_together_last_beyond_the_span_are_refused(shared):
    from replay.errors import ReplayError
    from replay.inference_perf import parse_inference_perf

    spec = _general_lite(shared)
    spec["load"]["stages"] = [{"rate": 1e-8, "duration": 6e8}, {"rate": 1e-8, "duration": 6e8}]
    with pytest.raises(ReplayError, match=r"the stages last 1\.2e\+09 s together, more than 1e\+09 s"):
        parse_inference_perf(spec)


@pytest.mark.parametrize(("text", "error", "hint"), [
    ("kv_offloading_size: 1e30", "kv_offloading_size must be float, not '1e30'",
     "hint: YAML reads 1e30 as text, not a number: write a dot and a signed exponent, e.g. kv_offloading_size: 1.0e+30"),
    ("max_num_seqs: 1e3", "max_num_seqs must be int, not '1e3'",
     "hint: YAML reads 1e3 as text, not a number: write the whole number, e.g. max_num_seqs: 1000"),
])
def test_an_engine_file_number_yaml_reads_as_text_says_how_to_write_it(tmp_path, text, error, hint):
    engine = tmp_path / "engine.yaml"
    engine.write_text(text + "\n")
    done = _run("replay", "--workload", "azure-conv", "--requests", "5", "--engine-config", str(engine), "--out",
                str(tmp_path / "run"))
    assert done.exit_code == 3, done.output
    assert f"error: {engine}: {error}" in done.output and hint in done.output
    assert yaml.safe_load("kv_offloading_size: 1.0e+30")["kv_offloading_size"] == 1e30  # the hint's spelling reads
