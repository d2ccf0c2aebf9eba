"""``servelens.settings.read_document``: every YAML or JSON file a user hands over, and each way it can be bad."""

from __future__ import annotations

import pytest

from servelens.errors import ConfigError
from servelens.settings import read_document


def test_a_document_is_read_as_yaml_or_by_its_suffix_as_json(tmp_path):
    (tmp_path / "a.yaml").write_text("a: 1\nb: {c: [2, 3]}\n")
    (tmp_path / "a.json").write_text('{"a": 1, "a2": null}')
    (tmp_path / "empty.yaml").write_text("")
    assert read_document(tmp_path / "a.yaml", "engine file") == {"a": 1, "b": {"c": [2, 3]}}
    assert read_document(tmp_path / "a.json", "calibration") == {"a": 1, "a2": None}
    assert read_document(tmp_path / "empty.yaml", "engine file") is None


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.yaml", None, "does not exist"),
    ("dup.yaml", "tensor_parallel_size: 2\nmax_num_seqs: 8\ntensor_parallel_size: 4\n",
     "'tensor_parallel_size' is given twice"),
    ("deep.yaml", "[" * 100_000 + "]" * 100_000, "is not valid YAML: nested too deeply to read"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "is not valid JSON: nested too deeply to read"),
    ("binary.yaml", b"\xff\xfe\x00a: 1", "is not valid YAML: not UTF-8 text \\(byte 0\\)"),
    ("broken.json", '{"a": ', "is not valid JSON: Expecting value"),
    ("broken.yaml", "a: [\n", "is not valid YAML"),
])
def test_each_fault_is_an_error_naming_the_file_and_what_it_is(tmp_path, name, content, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"^engine file {path} .*{message}") as info:
        read_document(path, "engine file", "fix the file")
    assert info.value.hint == "fix the file"


def test_a_folder_is_not_a_document(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        read_document(tmp_path, "gate configuration")
