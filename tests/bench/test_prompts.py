import json
import re
from pathlib import Path

import pandas as pd
import pytest

from mtad_energy.bench import prompts as P
from mtad_energy.bench.prompts import DATASET_HELP, DATASETS, DatasetNotAvailableError, load_prompts

SPIDER_DEV = [
    {"db_id": "concert_singer", "question": "How many singers do we have?",
     "query": "SELECT count(*) FROM singer"},
    {"db_id": "pets_1", "question": "Find the number of pets.", "query": "SELECT count(*) FROM pets"},
    {"db_id": "concert_singer", "question": "List all stadium names.", "query": "SELECT name FROM stadium"},
]
SPIDER_TABLES = [{
    "db_id": "concert_singer",
    "table_names_original": ["stadium", "singer"],
    "column_names_original": [[-1, "*"], [0, "Stadium_ID"], [0, "Name"], [1, "Singer_ID"], [1, "Stadium"]],
    "column_types": ["text", "number", "text", "number", "number"],
    "primary_keys": [1, 3],
    "foreign_keys": [[4, 1]],
}]


@pytest.fixture(autouse=True)
def data_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "data"
    monkeypatch.setenv("MTAD_ENERGY_DATA", str(root))
    return root


def write_spider(folder: Path, tables: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dev.json").write_text(json.dumps(SPIDER_DEV))
    if tables:
        (folder / "tables.json").write_text(json.dumps(SPIDER_TABLES))
    return folder


# --- Spider -------------------------------------------------------------------------------------------


def test_spider_from_the_data_root_with_schema(data_root):
    write_spider(data_root / "spider")
    ps = load_prompts("spider")
    assert [p.id for p in ps] == ["spider/dev/0", "spider/dev/1", "spider/dev/2"]
    assert all(p.dataset == "spider" for p in ps)
    assert "How many singers do we have?" in ps[0].text
    assert ps[0].reference == "SELECT count(*) FROM singer"
    assert "CREATE TABLE stadium (Stadium_ID number, Name text, PRIMARY KEY (Stadium_ID));" in ps[0].text
    assert "FOREIGN KEY (Stadium) REFERENCES stadium(Stadium_ID)" in ps[0].text
    # pets_1 has no entry in tables.json: the question still comes through
    assert "Find the number of pets." in ps[1].text and "not available" in ps[1].text


def test_spider_without_tables_and_in_a_subfolder(data_root):
    write_spider(data_root / "spider" / "spider_data", tables=False)  # as the zip unpacks
    ps = load_prompts("spider", 2)
    assert len(ps) == 2 and "CREATE TABLE" not in ps[0].text
    assert "Database: concert_singer" in ps[0].text


def test_spider_explicit_file_and_folder(tmp_path):
    folder = write_spider(tmp_path / "elsewhere")
    by_dir = load_prompts(f"spider:{folder}")
    by_file = load_prompts(f"spider:{folder / 'dev.json'}", 1)
    assert by_dir[0] == by_file[0] and len(by_file) == 1
    assert "CREATE TABLE singer" in by_file[0].text


def test_prompt_ids_are_unique_and_stable(data_root):
    write_spider(data_root / "spider")
    first, second = load_prompts("spider"), load_prompts("spider")
    assert [p.id for p in first] == [p.id for p in second]
    assert len({p.id for p in first}) == len(first)


def test_spider_missing_field_names_file_and_record(tmp_path):
    bad = tmp_path / "dev.json"
    bad.write_text(json.dumps([SPIDER_DEV[0], {"db_id": "x", "question": "q?"}]))
    with pytest.raises(ValueError) as e:
        load_prompts(f"spider:{bad}")
    assert str(e.value) == (f"{bad}: record 1: missing or empty field 'query' "
                            "(fields present: db_id, question)")


def test_spider_malformed_tables_json(tmp_path):
    folder = write_spider(tmp_path / "s", tables=False)
    (folder / "tables.json").write_text(json.dumps([{"db_id": "concert_singer"}]))
    with pytest.raises(ValueError, match=r"tables\.json: record 0 \(db_id 'concert_singer'\): malformed"):
        load_prompts(f"spider:{folder}")


def test_invalid_json_names_the_line(tmp_path):
    bad = tmp_path / "dev.json"
    bad.write_text('[\n{"db_id": "a",\n oops}\n]')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:3: invalid JSON"):
        load_prompts(f"spider:{bad}")


# --- CNN/DailyMail ----------------------------------------------------------------------------------

CNN_ROWS = [
    {"id": "a1", "article": "The council voted on Tuesday, to build, a new bridge.\nIt opens in 2026.",
     "highlights": "Council approves new bridge ."},
    {"id": "b2", "article": "Scientists found water on a distant moon.",
     "highlights": "Water found on moon ."},
    {"id": "c3", "article": "Local team wins the cup.", "highlights": "Team wins cup ."},
]


def test_cnn_dailymail_csv(data_root):
    folder = data_root / "cnn_dailymail"
    folder.mkdir(parents=True)
    pd.DataFrame(CNN_ROWS).to_csv(folder / "test.csv", index=False)
    ps = load_prompts("cnn_dailymail")
    assert [p.id for p in ps] == ["cnn_dailymail/test/0", "cnn_dailymail/test/1", "cnn_dailymail/test/2"]
    assert ps[0].text == "Summarize the following article:\n\n" + CNN_ROWS[0]["article"]
    assert ps[1].reference == "Water found on moon ."


def test_cnn_dailymail_sharded_parquet_in_subfolder(data_root):
    folder = data_root / "cnn_dailymail" / "3.0.0"  # the Hugging Face repository's layout
    folder.mkdir(parents=True)
    pd.DataFrame(CNN_ROWS).to_parquet(folder / "test-00000-of-00001.parquet")
    ps = load_prompts("cnn_dailymail", 2)
    assert [p.id for p in ps] == ["cnn_dailymail/test/0", "cnn_dailymail/test/1"]
    assert "distant moon" in ps[1].text


def test_cnn_dailymail_jsonl_explicit_path(tmp_path):
    path = tmp_path / "validation.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in CNN_ROWS) + "\n")
    ps = load_prompts(f"cnn_dailymail:{path}", 1)
    assert ps[0].id == "cnn_dailymail/validation/0" and ps[0].reference == "Council approves new bridge ."


def test_cnn_dailymail_missing_column(tmp_path):
    path = tmp_path / "test.csv"
    pd.DataFrame([{"id": "x", "article": "text"}]).to_csv(path, index=False)
    with pytest.raises(ValueError) as e:
        load_prompts(f"cnn_dailymail:{path}")
    assert str(e.value) == (f"{path}: record 0: missing or empty field 'highlights' "
                            "(fields present: id, article)")


# --- ChatAlpaca ---------------------------------------------------------------------------------------

CHATS = [
    {"id": "c0", "conversations": [{"from": "human", "value": "Name three primary colours."},
                                   {"from": "gpt", "value": "Red, blue and yellow."},
                                   {"from": "human", "value": "And secondary?"},
                                   {"from": "gpt", "value": "Green, orange, purple."}]},
    {"id": "c1", "messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is 2+2?"},
                              {"role": "assistant", "content": "4"}]},
    {"id": "c2", "conversations": [{"role": "user", "content": "Unanswered question"}]},
]


def test_chatalpaca_json_lines_named_json(data_root):
    folder = data_root / "chatalpaca"
    folder.mkdir(parents=True)
    # the real chatalpaca-10k.json is JSON Lines despite its name
    (folder / "chatalpaca-10k.json").write_text("\n".join(json.dumps(c) for c in CHATS))
    ps = load_prompts("chatalpaca")
    assert [p.id for p in ps] == ["chatalpaca/0", "chatalpaca/1", "chatalpaca/2"]
    assert (ps[0].text, ps[0].reference) == ("Name three primary colours.", "Red, blue and yellow.")
    assert (ps[1].text, ps[1].reference) == ("What is 2+2?", "4")
    assert (ps[2].text, ps[2].reference) == ("Unanswered question", None)


def test_chatalpaca_json_array_and_bare_message_lists(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([CHATS[0], CHATS[1]["messages"]]))  # older releases: bare lists
    ps = load_prompts(f"chatalpaca:{path}")
    assert [p.text for p in ps] == ["Name three primary colours.", "What is 2+2?"]


def test_chatalpaca_malformed_turn(tmp_path):
    path = tmp_path / "chats.jsonl"
    bad = {"id": "x", "conversations": [{"from": "human"}]}
    path.write_text(json.dumps(CHATS[0]) + "\n\n" + json.dumps(bad))
    with pytest.raises(ValueError) as e:
        load_prompts(f"chatalpaca:{path}")
    assert str(e.value) == f"{path}:3: turn 0: needs 'from' and 'value' (or 'role' and 'content') strings"


def test_chatalpaca_missing_conversations(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"id": "x", "text": "hi"}))
    with pytest.raises(ValueError, match=r":1: missing field 'conversations' .*fields present: id, text"):
        load_prompts(f"chatalpaca:{path}")


# --- awesome-chatgpt-prompts ----------------------------------------------------------------------------


def test_chatgpt_prompts_csv(data_root):
    folder = data_root / "chatgpt_prompts"
    folder.mkdir(parents=True)
    (folder / "prompts.csv").write_text(
        'act,prompt\n"Linux Terminal","I want you to act as a linux terminal, reply with ""output"" only."\n'
        '"Poet","I want you to act as a poet.\nWrite about love."\n')
    ps = load_prompts("chatgpt_prompts")
    assert [p.id for p in ps] == ["chatgpt_prompts/0", "chatgpt_prompts/1"]
    assert ps[0].text == 'I want you to act as a linux terminal, reply with "output" only.'
    assert ps[1].text == "I want you to act as a poet.\nWrite about love." and ps[1].reference is None


# --- missing data, unknown names, bundled sets ---------------------------------------------------------


def test_missing_dataset_error_says_what_where_and_how(data_root):
    with pytest.raises(DatasetNotAvailableError) as e:
        load_prompts("spider", 3)
    msg = str(e.value)
    assert isinstance(e.value, FileNotFoundError)
    assert msg.startswith("dataset 'spider' is not available locally; tried:")
    assert f"  {data_root / 'spider' / 'dev.json'}\n" in msg
    assert f"  {data_root / 'spider' / '*' / 'dev.json'}\n" in msg
    assert "expected: Spider's dev.json (a JSON list of {db_id, question, query})" in msg
    assert ("download Spider from https://yale-lily.github.io/spider and unpack dev.json and tables.json "
            f"into {data_root / 'spider'}") in msg
    assert "--dataset spider:/path" in msg and "MTAD_ENERGY_DATA=/dir" in msg


def test_missing_explicit_file_lists_it(tmp_path):
    gone = tmp_path / "nope" / "prompts.csv"
    with pytest.raises(DatasetNotAvailableError) as e:
        load_prompts(f"chatgpt_prompts:{gone}")
    msg = str(e.value)
    assert f"tried:\n  {gone}\n" in msg
    assert ("download prompts.csv from https://github.com/f/awesome-chatgpt-prompts and put it into "
            f"{gone.parent}") in msg


@pytest.mark.parametrize("name,expected", [
    ("cnn_dailymail", "test.csv"), ("chatalpaca", "chatalpaca*.json"), ("chatgpt_prompts", "prompts.csv")])
def test_missing_data_lists_every_candidate(data_root, name, expected):
    (data_root / name).mkdir(parents=True)
    with pytest.raises(DatasetNotAvailableError) as e:
        load_prompts(name)
    assert f"  {data_root / name / expected}\n" in str(e.value)
    assert "does not exist" not in str(e.value)


def test_unknown_dataset_lists_all_names():
    with pytest.raises(ValueError) as e:
        load_prompts("squad")
    msg = str(e.value)
    assert msg.startswith("unknown dataset 'squad': use one of ")
    for name in DATASETS:
        assert name in msg
    with pytest.raises(ValueError, match="bundled and takes no path"):
        load_prompts("mtbench:/tmp/x")


def test_dataset_help_covers_every_dataset():
    assert set(DATASET_HELP) == set(DATASETS)
    assert all(line and "\n" not in line for line in DATASET_HELP.values())


def test_n_truncates(data_root):
    write_spider(data_root / "spider")
    assert len(load_prompts("spider", 1)) == 1 and load_prompts("spider", 0) == []
    assert len(load_prompts("mtbench", 5)) == 5


def test_bundled_sets_are_complete():
    mt = load_prompts("mtbench")
    he = load_prompts("humaneval")
    assert len(mt) == 80 and len({p.id for p in mt}) == 80
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].reference


def test_jsonl_still_works(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "a", "prompt": "hello"}\n{"question": "why?"}\n')
    ps = load_prompts(str(path))
    assert [(p.id, p.text, p.dataset) for p in ps] == [("a", "hello", "mine"), ("1", "why?", "mine")]


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "dev.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '\.txt'"):
        P.spider(path=path)
