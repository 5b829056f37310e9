import gzip
import json

import pytest

from draftsmith.prompts import LoadStats, PromptError, load_prompts, source_identity


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sharegpt_jsonl_and_array(tmp_path):
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                      {"from": "human", "value": "More?"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "Be brief"}, {"from": "human", "value": "Q"}]},
    ]
    for path in (_jsonl(tmp_path / "s.jsonl", recs), tmp_path / "s.json"):
        if path.suffix == ".json":
            path.write_text(json.dumps(recs, indent=1))
        ps = load_prompts(str(path))
        assert [p.id for p in ps] == ["a", "b"]
        assert ps[0].turns == ["Hi", "More?"]  # assistant turns are kept apart (regenerated, or backend dataset's)
        assert ps[0].answers == ["Hello", None]
        assert ps[1].system == "Be brief" and ps[1].turns == ["Q"] and ps[1].answers == [None]


def test_openai_messages_and_fallback_ids(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                      {"role": "assistant", "content": "A"}, {"role": "user", "content": "U2"}]},
    ])
    (p,) = load_prompts(str(path))
    assert p.id == "m-1" and p.system == "S" and p.turns == ["U1", "U2"] and p.answers == ["A", None]


def test_answers_pair_with_their_turns_and_require_answers_counts_drops(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [
        # a reply before any user turn answers nothing; a second reply in a row is not the answer
        {"id": "x", "conversations": [{"from": "gpt", "value": "Welcome"}, {"from": "human", "value": "Q1"},
                                      {"from": "gpt", "value": "A1"}, {"from": "gpt", "value": "A1 again"},
                                      {"from": "human", "value": "Q2"}, {"from": "human", "value": "Q3"},
                                      {"from": "gpt", "value": "A3"}]},
        {"id": "y", "messages": [{"role": "user", "content": "only a question"}]},
        {"id": "z", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "   "}]},
        # a blank reply gives way to the next one
        {"id": "w", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""},
                                 {"role": "assistant", "content": "A"}]},
    ])
    (x, *_) = load_prompts(str(path))
    assert x.turns == ["Q1", "Q2", "Q3"] and x.answers == ["A1", None, "A3"]
    st = LoadStats()
    kept = load_prompts(str(path), require_answers=True, stats=st)
    # x ends before Q2 (unanswered: Q3's reply answers a conversation we no longer have); y has no
    # reply, z's is blank: both left out and counted
    assert [(p.id, p.turns, p.answers) for p in kept] == [("x", ["Q1"], ["A1"]), ("w", ["Q"], ["A"])]
    assert st.no_answer == 2 and st.filtered == 0
    with pytest.raises(PromptError, match="without a reply to their first turn 1: backend dataset needs"):
        load_prompts(str(_jsonl(tmp_path / "b.jsonl", [{"id": "y", "messages": [{"role": "user", "content": "Q"}]}])),
                     require_answers=True)
    with pytest.raises(PromptError, match="offset 5 skips all 2 selected"):
        load_prompts(str(path), require_answers=True, offset=5)


def test_duplicate_ids_are_numbered_before_the_filters(tmp_path):
    """`a#2` names the second record with id a, whatever the filters drop: a sample kept under a
    changed min_chars is never reused for another record."""
    path = _jsonl(tmp_path / "d.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "short"}]},
                                         {"id": "a", "messages": [{"role": "user", "content": "a longer one"}]}])
    assert [(p.id, p.turns[0]) for p in load_prompts(str(path))] == [("a", "short"), ("a#2", "a longer one")]
    assert [(p.id, p.turns[0]) for p in load_prompts(str(path), min_chars=6)] == [("a#2", "a longer one")]


def test_mtbench_and_humaneval_files(tmp_path):
    mt = _jsonl(tmp_path / "question.jsonl", [{"question_id": 81, "category": "writing", "turns": ["T1", "T2"]}])
    (p,) = load_prompts(str(mt))
    assert p.id == "mt-bench-81" and p.turns == ["T1", "T2"]
    he = tmp_path / "HumanEval.jsonl.gz"
    he.write_bytes(gzip.compress(json.dumps({"task_id": "HumanEval/7", "prompt": "def f():\n"}).encode() + b"\n"))
    (p,) = load_prompts(str(he))
    assert p.id == "HumanEval-7" and "def f():" in p.turns[0]


def test_shipped_sources():
    mt = load_prompts("mt-bench")
    assert len(mt) == 80 and mt[0].id == "mt-bench-81" and len(mt[0].turns) == 2
    he = load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval-0"
    st = LoadStats()
    sg = load_prompts("sharegpt", limit=50, first_turn_only=True, min_chars=8, max_chars=2000, skip_invalid=True, stats=st)
    assert len(sg) == 50 and all(len(p.turns) == 1 and 8 <= len(p.turns[0]) <= 2000 for p in sg)
    assert len({p.id for p in sg}) == 50
    replied = load_prompts("sharegpt", limit=50, first_turn_only=True, skip_invalid=True, require_answers=True)
    assert len(replied) == 50 and all(len(p.answers) == 1 and p.answers[0].strip() for p in replied)
    # a seed reads the whole file, to its cut tail (the wheel's file ends mid-string): what it has, no error
    st = LoadStats()
    seeded = load_prompts("sharegpt", limit=5, seed=0, skip_invalid=True, stats=st)
    assert len(seeded) == 5 and st.read > 17_000  # the wheel holds 17,672 conversations before the cut


def test_limit_seed_offset_are_deterministic(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", [{"question_id": i, "turns": [f"q{i}"]} for i in range(30)])
    first = load_prompts(str(path), limit=5)
    assert [p.id for p in first] == [f"mt-bench-{i}" for i in range(5)]
    a = load_prompts(str(path), limit=5, seed=1)
    b = load_prompts(str(path), limit=5, seed=1)
    c = load_prompts(str(path), limit=5, seed=2)
    assert [p.id for p in a] == [p.id for p in b] != [p.id for p in c]
    assert [p.id for p in load_prompts(str(path), offset=10, limit=2)] == ["mt-bench-10", "mt-bench-11"]


def test_duplicate_ids_stay_apart(tmp_path):
    conv = [{"from": "human", "value": "x"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"id": "a", "conversations": conv}] * 3)
    assert [p.id for p in load_prompts(str(path))] == ["a", "a#2", "a#3"]


@pytest.mark.parametrize(
    "content, match",
    [
        (b'{"id": "a", "conversations": [{"from": "human", "value": "x"}]}\n{"id": "b", "conv\n', r"bad\.jsonl:2: malformed JSON"),
        (b'{"id": "a", "conversations": []}\n', r"bad\.jsonl:1: empty conversation"),
        (b'{"id": "a", "conversations": [{"from": "robot", "value": "x"}]}\n', r"bad\.jsonl:1: .*unknown role 'robot'"),
        (b'{"messages": [{"role": "tool", "content": "x"}]}\n', r"bad\.jsonl:1: .*unknown role 'tool'"),
        (b'{"x": 1}\n{"bad": \xff\xfe}\n', r"bad\.jsonl:2: invalid UTF-8"),
        (b'{"foo": 1}\n', r"bad\.jsonl:1: unknown record format"),
        (b'{"id": "a", "conversations": [{"from": "human", "value": 5}]}\n', r"bad\.jsonl:1: field .*must be a string"),
        (b"", r"bad\.jsonl: the file is empty"),
    ],
)
def test_malformed_records_name_file_and_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptError, match=match) as e:
        load_prompts(str(path))
    assert "\n" not in str(e.value)


def test_skip_invalid_counts_instead_of_dropping_silently(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"id": "a", "conversations": [{"from": "human", "value": "ok"}]}\n{broken\n'
                    '{"id": "c", "conversations": []}\n')
    st = LoadStats()
    ps = load_prompts(str(path), skip_invalid=True, stats=st)
    assert [p.id for p in ps] == ["a"]
    assert st.skipped_invalid == 2 and st.read == 3
    assert "mixed.jsonl:2" in st.invalid_examples[0]


def test_json_array_line_numbers_and_unclosed_array(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text('[\n {"id": "a", "conversations": [{"from": "human", "value": "x"}]},\n {"id": "b", "conversations": []}\n]\n')
    with pytest.raises(PromptError, match=r"arr\.json:3: empty conversation"):
        load_prompts(str(path))
    path.write_text('[\n {"id": "a", "conversations": [{"from": "human", "value": "x"}]},\n {"id": "b", "conv')
    with pytest.raises(PromptError, match=r"arr\.json:3: malformed JSON"):
        load_prompts(str(path))


def test_unknown_source_and_missing_file():
    with pytest.raises(PromptError, match="no such file .*sharegpt, mt-bench, humaneval"):
        load_prompts("/nonexistent/prompts.jsonl")


def test_context_tokens_needed_bounds_the_longest_conversation(tiny_target):
    from draftsmith.prompts import Prompt, context_tokens_needed
    from draftsmith.target import load_tokenizer

    tok = load_tokenizer(str(tiny_target))
    short, long = Prompt(id="a", turns=["hi"]), Prompt(id="b", turns=["one two three " * 20, "and again"], system="be brief")
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": long.turns[0]},
                                    {"role": "user", "content": long.turns[1]}], tokenize=False, add_generation_prompt=True)
    want = len(tok(text, add_special_tokens=False)["input_ids"]) + 2 * (64 + 16)
    assert context_tokens_needed([short, long], tok, 64) == want


# --- data sets through `datasets` ----------------------------------------------------------------------


def _rows(n: int, bad: int | None = None) -> list[dict]:
    """UltraChat-shaped rows (prompt_id, prompt, messages); row `bad` has a role no chat has."""
    rows = [{"prompt_id": f"u{i}", "prompt": f"q {i}", "messages": [{"role": "user", "content": f"question {i}"},
                                                                     {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(n)]
    if bad is not None:
        rows[bad]["messages"][0]["role"] = "robot"
    return rows


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory):
    """The same rows as a Parquet file, an Arrow (IPC stream) file and a save_to_disk folder, written here."""
    import datasets
    import pyarrow.ipc as ipc

    root = tmp_path_factory.mktemp("ds")
    d = datasets.Dataset.from_list(_rows(40, bad=5))
    d.to_parquet(str(root / "chats.parquet"))
    d.save_to_disk(str(root / "saved"))
    with ipc.new_stream(str(root / "chats.arrow"), d.data.table.schema) as w:
        w.write_table(d.data.table)
    no_ids = datasets.Dataset.from_list([{"messages": r["messages"]} for r in _rows(3)])
    no_ids.to_parquet(str(root / "no_ids.parquet"))
    return root


@pytest.mark.parametrize("name", ["chats.parquet", "chats.arrow", "saved"])
def test_prompts_from_parquet_arrow_and_saved_data_sets(dataset_files, name):
    src = str(dataset_files / name)
    st = LoadStats()
    ps = load_prompts(src, limit=4, stats=st, skip_invalid=True)
    assert [p.id for p in ps] == ["u0", "u1", "u2", "u3"] and ps[0].turns == ["question 0"]
    assert ps[0].answers == ["answer 0"] and st.read == 4  # read lazily: no row past what limit needs
    # a row that cannot be a prompt is named by its row, and skipped and counted (or collected, or raised)
    st = LoadStats()
    assert len(load_prompts(src, skip_invalid=True, stats=st)) == 39 and st.skipped_invalid == 1
    assert st.invalid_examples[0].startswith(f"{src}: row 5: messages[0]: unknown role 'robot'")
    invalid: list = []
    assert len(load_prompts(src, invalid=invalid)) == 39 and "row 5" in str(invalid[0])
    with pytest.raises(PromptError, match=r": row 5: messages\[0\]: unknown role"):
        load_prompts(src)
    # the fingerprint of the source changes with its content
    assert len(source_identity(src)["sha256"]) == 64


def test_rows_without_an_id_get_a_stable_one_and_the_hub_offline_is_one_line(dataset_files, monkeypatch):
    ids = [p.id for p in load_prompts(str(dataset_files / "no_ids.parquet"))]
    assert ids == [p.id for p in load_prompts(str(dataset_files / "no_ids.parquet"))]  # stable
    assert all(i.startswith(f"no_ids-{n}-") and len(i.split("-")[-1]) == 8 for n, i in enumerate(ids))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PromptError, match=r"^prompts: hf:nobody/nothing:train: cannot read the data set") as e:
        load_prompts("hf:nobody/nothing:train")
    assert "\n" not in str(e.value)
    assert source_identity("hf:HuggingFaceH4/ultrachat_200k:train_sft") == {
        "source": "hf:HuggingFaceH4/ultrachat_200k:train_sft"}


def test_a_damaged_data_set_file_is_one_line_of_draftsmiths_and_no_library_line(dataset_files, tmp_path, cli):
    """pyarrow's "Failed to read schema ..." (logged by datasets) came before draftsmith's own line."""
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + bytes(range(256)) * 4)
    p = cli("generate", "--run", str(tmp_path / "run"), "--prompts", str(bad), "--backend", "dataset")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        x for x in p.stderr.strip().splitlines() if x.startswith("draftsmith: error: prompts:")], p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "cannot read the data set (ArrowInvalid" in p.stderr
    assert "Failed to read schema" not in p.stdout + p.stderr


def test_generate_reads_a_parquet_file_and_resumes_by_row_id(dataset_files, tiny_target, tmp_path, cli):
    run = tmp_path / "run"
    args = ["generate", "--run", str(run), "--prompts", str(dataset_files / "chats.parquet"), "--backend", "dataset",
            "--set", f"target={tiny_target}", "--set", "generate.skip_invalid=true", "--set", "generate.limit=6"]
    p = cli(*args)
    assert p.returncode == 0, p.stderr
    ids = [json.loads(x)["id"] for x in (run / "generate" / "samples.jsonl").read_text().splitlines()]
    assert ids == ["u0", "u1", "u2", "u3", "u4", "u6"]  # row 5 skipped, counted
    p = cli(*args[:-1], "generate.limit=8")
    assert p.returncode == 0 and "6 already done" in p.stdout + p.stderr, p.stdout + p.stderr


@pytest.mark.parametrize("how", ["kept as failures", "skip_invalid", "raised"])
def test_a_file_whose_every_record_is_invalid_names_the_first_and_counts_them(tmp_path, how):
    """It said "invalid 0" and named no row when generate kept the invalid records as failures."""
    path = _jsonl(tmp_path / "bad.jsonl", [{"foo": 1}, {"bar": 2}, {"messages": []}])
    with pytest.raises(PromptError) as e:
        if how == "kept as failures":
            load_prompts(str(path), invalid=[])
        else:
            load_prompts(str(path), skip_invalid=how == "skip_invalid")
    msg = str(e.value)
    assert "bad.jsonl:1:" in msg and "unknown record format" in msg and "\n" not in msg
    if how != "raised":
        assert "no usable prompts (read 3, invalid 3" in msg
