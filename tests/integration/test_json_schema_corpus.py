"""Structured output (issue 23 item 3): every schema of tests/data/json_schema_corpus.json compiles (router/
json_schema.c) and every output drawn through the engine's token masks over the real 49,152-token vocabulary
(tests/unit/router/schema_gen_tool.c: random choices among the allowed tokens, so the strings are adversarial)
parses as JSON and validates with Python's jsonschema (Draft 2020-12, formats checked too)."""
import json
import pathlib
import subprocess

import jsonschema

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "json_schema_corpus.json"
N_PER_SCHEMA = 8


def test_corpus_outputs_validate(baton_bin, default_model):
    corpus = json.loads(CORPUS.read_text())
    assert len(corpus) >= 50
    tool = baton_bin.parent / "schema_gen_tool"
    r = subprocess.run([str(tool), str(default_model), str(CORPUS), str(N_PER_SCHEMA), "7"], capture_output=True,
                       text=True, timeout=600, check=True)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["name"] for x in lines] == [c["name"] for c in corpus]
    checked, unfinished, failures = 0, 0, []
    for entry, line in zip(corpus, lines):
        assert "error" not in line, f"{entry['name']}: {line.get('error')}"
        assert line["errors"] == 0, entry["name"]
        # a random walk may recurse until it runs out of steps (recursive schemas): those are only counted
        assert line["outputs"], f"{entry['name']}: all {line['unfinished']} outputs unfinished"
        unfinished += line["unfinished"]
        validator = jsonschema.Draft202012Validator(entry["schema"], format_checker=jsonschema.FormatChecker())
        for text in line["outputs"]:
            try:
                validator.validate(json.loads(text))
                checked += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append(f"{entry['name']}: {text!r}: {str(e).splitlines()[0]}")
    print(f"{checked} outputs of {len(corpus)} schemas validated, {len(failures)} failed, {unfinished} unfinished")
    assert not failures, "\n".join(failures[:20])
