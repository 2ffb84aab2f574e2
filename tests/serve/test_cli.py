"""``xoffload serve``'s command line: the engine options (shared with needle and generate), prefix
caching on by default where the mode takes it, one-line errors, and the app handed to uvicorn."""
import pytest

from xoffload import cli
from xoffload.serve.cli import engine_options


def _args(*argv):
    return cli.build_parser().parse_args(["serve", "tiny-llama", *argv])


@pytest.mark.parametrize("argv,prefix", [
    ([], True),  # offload, batched
    (["--mode", "gpu"], True),  # resident, max_num_seqs 8, dense decode
    (["--mode", "resident", "--max-num-seqs", "1"], True),  # a batch of one: the store epoch's blocks
    (["--mode", "resident", "--sparse-decode", "quest"], True),  # the Quest store over a device pool
    (["--no-prefix-caching"], False),
])
def test_prefix_caching_default_where_supported(argv, prefix):
    kw = engine_options(_args(*argv), "cpu")
    assert kw["prefix_caching"] is prefix and kw["max_num_seqs"] == (1 if "1" in argv else 8)
    assert kw["prefill_attn"] == "sdpa" and kw["kv_block_size"] == 1024


def test_explicit_prefix_caching_is_kept_where_the_mode_takes_it():
    kw = engine_options(_args("--mode", "resident", "--sparse-decode", "quest", "--prefix-caching"), "cpu")
    assert kw["prefix_caching"] is True


def test_explicit_prefix_caching_the_config_refuses_is_one_line(monkeypatch, capsys):
    # no serve option refuses prefix caching today (only tensor parallelism does, which serve does
    # not take); the refusal path is driven through the config's own reason
    from xoffload.engine.config import EngineConfig

    monkeypatch.setattr(EngineConfig, "_prefix_caching_refusal", lambda self: "it needs one device, got 2")
    rc = cli.main(["serve", "tiny-llama", "--prefix-caching"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("xoffload serve: error: prefix_caching")
    assert "got 2" in err


@pytest.mark.parametrize("argv,words", [(["--max-num-seqs", "0"], "--max-num-seqs must be an int >= 1, got 0"),
                                        (["--max-queue", "-1"], "--max-queue must be an int >= 0, got -1"),
                                        (["--shutdown-timeout", "-2"], "--shutdown-timeout must be a number >= 0")])
def test_bad_values_are_one_argparse_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "tiny-llama", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_serve_builds_the_app_and_runs_uvicorn(monkeypatch):
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    seen = {}

    def fake_run(self, sockets=None):
        seen.update(config=self.config, server=self)

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    monkeypatch.setenv("XOFFLOAD_API_KEY", "from-env")
    rc = cli.main(["serve", "tiny-llama", "--device", "cpu", "--max-model-len", "256", "--kv-block-size", "64",
                   "--port", "0", "--shutdown-timeout", "3", "--max-queue", "5"])
    cfg = seen["config"]
    assert rc == 0 and cfg.timeout_graceful_shutdown > 3 and cfg.port == 0
    app = cfg.app
    loop = app.state.loop
    e = loop.engine
    assert e.config.mode == "offload" and e.config.prefix_caching and e.config.max_num_seqs == 8
    assert loop.max_queue == 5
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401  # the key came from the environment
        r = c.get("/v1/models", headers={"Authorization": "Bearer from-env"})
        assert r.json()["data"][0]["id"] == "tiny-llama"
        seen["server"].handle_exit(15, None)  # SIGTERM: the app drains, new requests get 503
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2]},
                   headers={"Authorization": "Bearer from-env"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert e.closed  # the lifespan's shutdown closed the engine


def test_kv_cache_dtype_reaches_the_engine_options():
    """``--kv-cache-dtype fp8 --kv-cache-scale token`` (the shared model options) become the
    engine's ``kv_cache_dtype`` / ``kv_cache_scale``; the default passes neither."""
    kw = engine_options(_args("--kv-cache-dtype", "fp8", "--kv-cache-scale", "token"), "cpu")
    assert kw["kv_cache_dtype"] == "fp8" and kw["kv_cache_scale"] == "token"
    assert "kv_cache_dtype" not in engine_options(_args(), "cpu")


def test_kv_cache_dtype_fp8_with_resident_mode_is_one_line(capsys):
    rc = cli.main(["serve", "tiny-llama", "--mode", "resident", "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "kv_cache_dtype='fp8'" in err and "'resident'" in err


def test_bad_kv_cache_dtype_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "tiny-llama", "--kv-cache-dtype", "int4"])
    assert e.value.code == 2 and "int4" in capsys.readouterr().err
