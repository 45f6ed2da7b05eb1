"""Local data files a user can get wrong: each is one DataError naming the file (and the line)."""

import json

import pytest

from headway.train.data import DataError, build_datasets

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GOOD = json.dumps(ROW) + "\n"

CASES = {  # name -> (file bytes, what the error must say; {path} is the file)
    "non_utf8": (GOOD.encode() + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',
                 "{path}:2 is not UTF-8 text (byte 47 of the line is 0xe9)"),
    "empty": (b"", "{path} is empty"),
    "blank": (b"\n  \n\t\n", "{path} is empty"),
    "truncated": ((GOOD + GOOD[:30]).encode(), "{path}:2 is not valid JSON"),
    "not_an_object": ((GOOD + "[1, 2]\n").encode(), "{path}:2 is a JSON list, not an object"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_conversation_file_names_file_and_line(case, tmp_path, tiny_tokenizer):
    content, message = CASES[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        build_datasets({"source": str(path), "val_fraction": 0, "cache_dir": str(tmp_path / "cache")},
                       tiny_tokenizer, 64)
    assert message.format(path=path) in str(info.value) and "\n" not in str(info.value)


def test_blank_lines_between_rows_are_fine(tmp_path, tiny_tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n" + GOOD)
    train_ds, _ = build_datasets({"source": str(path), "val_fraction": 0, "cache_dir": str(tmp_path / "cache")},
                                 tiny_tokenizer, 64)
    assert len(train_ds) == 2
