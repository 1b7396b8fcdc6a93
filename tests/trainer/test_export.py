"""`finetune export`: a trained model pushed to a real OCI registry (distribution, TLS from a
CA of the test's, htpasswd basic auth) and pulled back with the real oras CLI, as a user and
KAITO's puller read it; committed to a Hugging Face Hub through the real huggingface_hub
client, against a stand-in of the hub's upload API (tests/support/hub_fake.py: no hub is
reachable here; it speaks git-LFS, so those runs set HF_HUB_DISABLE_XET=1), and read back
with snapshot_download; refused pushes said with the fix, nothing half-pushed."""

from __future__ import annotations

import base64
import filecmp
import json
import os
import socket
import subprocess
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import pytest

from finetune_trainer.export import ExportError, hub, model_folder, oci
from tests.conftest import REPO
from tests.support import registry as registries
from tests.support import waits
from tests.support.hub_fake import FakeHub
from tests.trainer.test_training import shared_run

HUB_TOKEN = "hf_stand-in-write-token"


@pytest.fixture()
def trained(tiny_model_dir, shared) -> Path:
    """The output folder of the session's DDP LoRA run of the tiny model (test_training's)."""
    return shared_run(shared, tiny_model_dir, "ddp", "lora")


@pytest.fixture()
def hub_stand_in():
    """An empty hub that takes uploads with HUB_TOKEN."""
    with FakeHub({}, writer=HUB_TOKEN) as started:
        yield started


def hub_env(stand_in: FakeHub, token: str | None = HUB_TOKEN) -> dict[str, str]:
    """What a user of another hub sets (HF_ENDPOINT), its token, and hf_xet switched off (the
    stand-in speaks git-LFS, not Xet)."""
    return {"HF_ENDPOINT": stand_in.url, "HF_HUB_DISABLE_XET": "1",
            **({"HF_TOKEN": token} if token else {})}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with registries.running(tmp_path_factory.mktemp("registry")) as started:
        yield started


def finetune_export(*args: str, home: Path, docker_config: Path | None = None,
                    ca: Path | None = None, hub_at: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    """`finetune export` as a user runs it, with only the credentials given here."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("DOCKER_CONFIG", "REGISTRY_AUTH_FILE", "REQUESTS_CA_BUNDLE",
                          "HF_TOKEN", "HF_ENDPOINT")}
    env.update(HOME=str(home), **(hub_at or {}))
    if docker_config is not None:
        env["DOCKER_CONFIG"] = str(docker_config)
    if ca is not None:
        env["REQUESTS_CA_BUNDLE"] = str(ca)
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", "export", *args],
                          capture_output=True, text=True, env=env, timeout=waits.seconds_left())


def generated(model_dir: Path, adapter: Path) -> list[int]:
    """Greedy tokens of the base with `adapter` on: what the adapter answers a prompt."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    prompt = tokenizer("the model learns", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


@pytest.mark.process
def test_an_exported_adapter_comes_back_with_oras_and_answers_as_before(
        registry, trained, tiny_model_dir, tmp_path):
    output = trained
    reference = f"{registry.host}/models/tiny-adapter:v1"
    config = registry.docker_config(tmp_path / "docker")
    pushed = finetune_export(str(output), f"oci://{reference}", home=tmp_path,
                             docker_config=config, ca=registry.ca)
    assert pushed.returncode == 0, pushed.stderr
    assert f"pushed {reference}@sha256:" in pushed.stdout

    pulled = registry.oras("pull", reference, "-o", str(tmp_path / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    final = output / "final"
    data = tmp_path / "pulled" / oci.DATA_DIR
    assert sorted(p.relative_to(data) for p in oci.model_files(data)) == sorted(
        p.relative_to(final) for p in oci.model_files(final))
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md"):
        assert filecmp.cmp(final / name, data / name, shallow=False), name
    assert generated(tiny_model_dir, data) == generated(tiny_model_dir, final)

    fetched = registry.oras("manifest", "fetch", reference)
    manifest = json.loads(fetched.stdout)
    assert manifest["config"]["mediaType"] == oci.CONFIG_TYPE  # what KAITO's skopeo takes
    assert manifest["layers"][0]["annotations"][oci.TITLE] == oci.DATA_DIR
    assert manifest["annotations"][oci.TITLE] == "t-ddp-lora"  # the job, from its card
    again = finetune_export(str(output), f"oci://{reference}", home=tmp_path,
                            docker_config=config, ca=registry.ca)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("@")[-1] == pushed.stdout.split("@")[-1]  # the same digest


@pytest.mark.process
def test_an_adapter_committed_to_the_hub_comes_back_with_snapshot_download_and_answers(
        hub_stand_in, trained, tiny_model_dir, tmp_path):
    """`finetune export OUTPUT hf://team/name`: the repository created private, final/'s
    files committed (weights by LFS, the rest inline) with the card as README.md, read back
    by huggingface_hub as a user would; a second export is a new commit that uploads no
    weights again."""
    from huggingface_hub import snapshot_download

    final = trained / "final"
    pushed = finetune_export(str(trained), "hf://team/tiny-adapter", home=tmp_path,
                             hub_at=hub_env(hub_stand_in))
    assert pushed.returncode == 0, pushed.stderr
    repo = hub_stand_in.repos["team/tiny-adapter"]
    assert repo.private and f"pushed hf://team/tiny-adapter@{repo.commit}" in pushed.stdout
    assert HUB_TOKEN not in pushed.stdout + pushed.stderr
    (commit,) = hub_stand_in.commits
    assert sorted(commit.files) == sorted(str(p.relative_to(final))
                                          for p in oci.model_files(final))
    by_lfs = {name for name, data in repo.files.items() if _sha_of(data) in hub_stand_in.lfs}
    assert by_lfs == {"adapter_model.safetensors"}

    pulled = Path(snapshot_download("team/tiny-adapter", endpoint=hub_stand_in.url,
                                    token=HUB_TOKEN, local_dir=tmp_path / "pulled"))
    for path in oci.model_files(final):
        assert filecmp.cmp(path, pulled / path.relative_to(final), shallow=False), path
    assert generated(tiny_model_dir, pulled) == generated(tiny_model_dir, final)

    uploads = [path for method, path in hub_stand_in.requests if method == "PUT"]
    again = finetune_export(str(trained), "hf://team/tiny-adapter", home=tmp_path,
                            hub_at=hub_env(hub_stand_in))
    assert again.returncode == 0, again.stderr
    assert len(hub_stand_in.commits) == 2 and f"@{repo.commit}" in again.stdout
    assert [path for method, path in hub_stand_in.requests if method == "PUT"] == uploads


def _sha_of(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@pytest.mark.process
@pytest.mark.parametrize("token", [None, "hf_not-the-writers"])
def test_a_hub_that_refuses_the_token_is_said_with_the_fix_and_nothing_is_made(
        hub_stand_in, trained, tmp_path, token):
    pushed = finetune_export(str(trained), "hf://team/refused", home=tmp_path,
                             hub_at=hub_env(hub_stand_in, token))
    assert pushed.returncode == 1
    assert "export to hf://team/refused: the hub refused the token (401" in pushed.stderr
    assert "give a token with write access to team" in pushed.stderr
    assert "--from-literal=token=" in pushed.stderr
    assert "hf_not-the-writers" not in pushed.stdout + pushed.stderr
    assert "team/refused" not in hub_stand_in.repos and not hub_stand_in.commits
    assert (trained / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.process
def test_a_targets_mounted_token_is_the_one_sent_not_hf_token(hub_stand_in, tmp_path):
    """In a worker, an hf:// target's Secret is a file (layout.export_credentials): its token
    pushes, while HF_TOKEN (the base model's read token) is not used for it."""
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    mounted = tmp_path / "token"
    mounted.write_text(HUB_TOKEN + "\n")  # as `kubectl create secret --from-file` keeps it
    script = ("import sys; from pathlib import Path; from finetune_trainer.export import "
              "export; print(export(Path(sys.argv[1]), 'hf://team/mounted', "
              "credentials=Path(sys.argv[2])))")
    env = {**os.environ, **hub_env(hub_stand_in, token="hf_a-read-token")}
    pushed = subprocess.run([sys.executable, "-c", script, str(folder), str(mounted)],
                            capture_output=True, text=True, env=env,
                            timeout=waits.seconds_left())
    assert pushed.returncode == 0, pushed.stderr
    assert hub_stand_in.repos["team/mounted"].files["config.json"] == b"{}"


@pytest.mark.process
@pytest.mark.parametrize("credentials", ["none", "wrong password"])
def test_a_refused_push_says_so_with_the_fix_and_pushes_nothing(registry, trained, tmp_path,
                                                                  credentials):
    reference = f"{registry.host}/models/refused:v1"
    config = (registry.docker_config(tmp_path / "docker", password="not-it")
              if credentials == "wrong password" else None)
    pushed = finetune_export(str(trained), f"oci://{reference}", home=tmp_path,
                             docker_config=config, ca=registry.ca)
    assert pushed.returncode == 1
    said = pushed.stderr
    assert f"export to {reference}: the registry refused the push" in said
    assert ("no credentials" if credentials == "none" else
            f"the credentials for {registry.host}") in said
    assert "docker login" in said and "dockerconfigjson" in said
    assert "not-it" not in said + pushed.stdout  # no secret in what is said
    assert registry.oras("manifest", "fetch", reference).returncode != 0


@pytest.mark.process
def test_a_registry_whose_ca_is_not_given_is_refused_naming_the_fix(registry, trained,
                                                                   tmp_path):
    pushed = finetune_export(str(trained), f"oci://{registry.host}/models/x:v1",
                             home=tmp_path, docker_config=registry.docker_config(tmp_path / "d"))
    assert pushed.returncode == 1
    assert "TLS to" in pushed.stderr and "REQUESTS_CA_BUNDLE" in pushed.stderr


@pytest.mark.process
def test_a_registry_without_tls_takes_plain_http_when_asked(trained, tmp_path):
    plain = registries.start(tmp_path / "plain", secure=False)
    try:
        reference = f"{plain.host}/adapters/open:latest"
        pushed = finetune_export(str(trained), f"oci://{plain.host}/adapters/open",
                                 "--plain-http", home=tmp_path)
        assert pushed.returncode == 0, pushed.stderr
        assert f"pushed {reference}@sha256:" in pushed.stdout  # the tag defaults to latest
        assert plain.oras("pull", reference, "-o", str(tmp_path / "pulled")).returncode == 0
        assert (tmp_path / "pulled" / "data" / "adapter_model.safetensors").is_file()
    finally:
        plain.process.terminate()
        plain.process.wait(timeout=30)


@pytest.mark.process
@pytest.mark.parametrize(("target", "said"), [
    ("oci://Registry.example.com/Models/X:v1", "names the repository 'Models/X', which a "
     "registry refuses: repository names are lowercase (OCI distribution spec); write models/x"),
    ("oci://127.0.0.1:5000/m/x@sha256:" + "a" * 64, "names a digest, which a push cannot "
     "target: the registry gives the digest of what it is sent; name a tag"),
    ("oci://127.0.0.1:5000/m/x:bad tag", "names the tag 'bad tag', which a registry refuses; "
     "use up to 128 letters, digits, _ . and -, not starting with . or -"),
    ("oci://127.0.0.1:5000/m/x:-v1", "names the tag '-v1'"),
    ("pvc://claim/models", "PersistentVolumeClaim (pvc://) locations are not accepted here"),
    ("oci://registry.example.com", "names no repository; write oci://<host[:port]>/"
                                   "<repository>[:tag]"),
    ("hf://team/my--adapter", "is not a hub repository name; write hf://owner/name"),
    ("hf://team/adapters/v1", "use oci://registry.example.com/models/name:tag or "
                              "hf://org/name"),
])
def test_a_bad_target_is_named_with_the_form_to_write(tmp_path, target, said):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    refused = finetune_export(str(tmp_path), target, home=tmp_path)
    assert refused.returncode == 1
    assert said in refused.stderr and f"export to {target}" in refused.stderr


@pytest.mark.process
def test_a_manifest_run_here_is_exported_from_its_output_folder(tmp_path):
    """OUTPUT may be the manifest `finetune run` ran, as for `finetune status` and `logs`:
    its spec.output.uri is the folder; another file is said to be neither."""
    from tests.trainer.test_training import manifest

    job = manifest(tmp_path / "model", Path("out"))
    job["spec"]["output"]["uri"] = "./out"
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    (tmp_path / "out" / "final").mkdir(parents=True)
    (tmp_path / "out" / "final" / "config.json").write_text("{}")
    refused = finetune_export("--merged", str(tmp_path / "job.yaml"), "oci://x.io/m/x:v1",
                              home=tmp_path)  # merged/ looked for in the manifest's folder
    assert refused.returncode == 1
    assert f"export of {tmp_path / 'out'}: holds no merged/ folder" in refused.stderr
    (tmp_path / "notes.txt").write_text("not a manifest")
    refused = finetune_export(str(tmp_path / "notes.txt"), "oci://x.io/m/x:v1", home=tmp_path)
    assert refused.returncode == 1
    assert (f"export of {tmp_path / 'notes.txt'}: is a file, neither a folder nor a valid "
            "FineTuneJob manifest") in refused.stderr
    cluster_job = REPO / "examples" / "02-aks-fsdp-full-8b.yaml"
    refused = finetune_export(str(cluster_job), "oci://x.io/m/x:v1", home=tmp_path)
    assert refused.returncode == 1
    assert "runs on a cluster: its output is not on this machine" in refused.stderr


@pytest.mark.process
def test_a_job_pushes_its_model_to_each_export_target_after_training(
        registry, hub_stand_in, tiny_model_dir, tmp_path):
    """`spec.output.export` under `finetune run`, 2 processes: once the model is written,
    rank 0 pushes final/ and merged/ to the registry with the user's own Docker login (the
    target's secretName is a cluster's, said so) and final/ to the hub with HF_TOKEN, and a
    target the registry refuses (plain HTTP to a TLS port) is recorded with its error while
    the run still succeeds, its model in the folder; each outcome in the final record,
    nothing secret said."""
    from tests.trainer.test_training import finetune_run, manifest

    output = tmp_path / "out"
    job = manifest(tiny_model_dir, output, steps=2, merge=True)
    targets = [{"uri": f"oci://{registry.host}/models/job:v1", "secretName": "regcred"},
               {"uri": f"oci://{registry.host}/models/job-merged:v1", "merged": True},
               {"uri": f"oci://{registry.host}/models/refused:v1", "plainHttp": True},
               {"uri": "hf://team/job", "secretName": "hf-token"}]
    job["spec"]["output"]["export"] = targets
    result = finetune_run(job, tmp_path, env={
        "HOME": str(tmp_path), "DOCKER_CONFIG": str(registry.docker_config(tmp_path / "d")),
        "REQUESTS_CA_BUNDLE": str(registry.ca), **hub_env(hub_stand_in)})
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-3000:]
    assert registries.PASSWORD not in said and HUB_TOKEN not in said
    assert (f"secret regcred is not mounted here: pushing to {targets[0]['uri']} with your "
            "own Docker login") in said
    assert ("secret hf-token is not mounted here: pushing to hf://team/job with HF_TOKEN or "
            "your hub login") in said
    final = json.loads((output / "progress.json").read_text())
    assert final["phase"] == "Succeeded"
    pushed, merged, refused, committed = final["exports"]
    repo = hub_stand_in.repos["team/job"]
    assert committed == {"uri": "hf://team/job", "pushed": f"hf://team/job@{repo.commit}"}
    assert {name: data for name, data in repo.files.items() if name != ".gitattributes"} == {
        str(p.relative_to(output / "final")): p.read_bytes()
        for p in oci.model_files(output / "final")}
    assert pushed["uri"] == targets[0]["uri"] and pushed["pushed"].startswith(
        f"{registry.host}/models/job:v1@sha256:")
    assert merged["pushed"].startswith(f"{registry.host}/models/job-merged:v1@sha256:")
    assert refused["uri"] == targets[2]["uri"] and "error" in refused
    assert f"(the model stays in {output})" in said
    for reference, folder in ((pushed, output / "final"), (merged, output / "merged")):
        where = tmp_path / "pulled" / folder.name
        pull = registry.oras("pull", reference["pushed"].split("@")[0], "-o", str(where))
        assert pull.returncode == 0, pull.stderr
        assert sorted(p.relative_to(where / oci.DATA_DIR) for p in oci.model_files(
            where / oci.DATA_DIR)) == sorted(p.relative_to(folder)
                                              for p in oci.model_files(folder))
    # the model card travels with it: ours, written before the push (peft's template once
    # went, the card replacing it after the push)
    card = (tmp_path / "pulled" / "final" / oci.DATA_DIR / "README.md").read_text()
    assert card == (output / "final" / "README.md").read_text() and "finetune-operator" in card
    assert registry.oras("manifest", "fetch", targets[2]["uri"][6:]).returncode != 0


# --- the parts, pure ------------------------------------------------------------------------

@pytest.mark.unit
def test_what_is_exported_of_an_output_folder(tmp_path):
    with pytest.raises(ExportError, match=f"^export of {tmp_path / 'missing'}: no such folder"):
        model_folder(tmp_path / "missing")  # the folder is what is wrong, not the target
    with pytest.raises(ExportError, match="holds no final/ folder and is no model folder"):
        model_folder(tmp_path)
    (tmp_path / "final").mkdir()
    assert model_folder(tmp_path) == tmp_path / "final"
    with pytest.raises(ExportError, match="mergeAdapter: true"):
        model_folder(tmp_path, merged=True)
    (tmp_path / "merged").mkdir()
    assert model_folder(tmp_path, merged=True) == tmp_path / "merged"
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    assert model_folder(tmp_path / "final") == tmp_path / "final"  # a model folder itself


@pytest.mark.unit
def test_a_folder_packs_the_same_twice_with_its_files_under_data(tmp_path):
    folder = tmp_path / "out" / "final"
    (folder / "nested").mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "nested" / "tokenizer.json").write_text("{}")
    (folder / ".partial").write_text("hidden: left out")
    (folder / "README.md").write_text("---\nbase_model: org/base\n---\n\n# my-job\n\n"
                                      "A LoRA adapter of org/base.\n")
    packs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        packs.append(oci.pack(folder, tmp_path / name))
    assert packs[0].manifest == packs[1].manifest  # reproducible, `created` included
    manifest = json.loads(packs[0].manifest)
    assert manifest["annotations"] == {
        oci.TITLE: "my-job", oci.DESCRIPTION: "A LoRA adapter of org/base.",
        oci.BASE_MODEL: "org/base", oci.CREATED: datetime.fromtimestamp(
            max(f.stat().st_mtime for f in folder.rglob("*")), timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")}
    with tarfile.open(packs[0].layer.path) as tar:
        assert tar.getnames() == ["data", "data/nested", "data/README.md",
                                  "data/adapter_config.json", "data/nested/tokenizer.json"]
        assert {m.mtime for m in tar.getmembers()} == {0}
    config = json.loads(packs[0].config.path.read_bytes())
    assert config["rootfs"]["diff_ids"] == [
        manifest["layers"][0]["annotations"][oci.TAR_DIGEST]]


@pytest.mark.unit
def test_credentials_are_read_as_docker_writes_them(tmp_path):
    encoded = base64.b64encode(b"me:pa:ss").decode()
    (tmp_path / "a.json").write_text(json.dumps({"auths": {
        "https://ghcr.io/v1/": {"auth": encoded},
        "myacr.azurecr.io": {"username": "00000000-0000", "password": "token"}}}))
    (tmp_path / "broken.json").write_text("{not json")
    configs = [tmp_path / "missing.json", tmp_path / "broken.json", tmp_path / "a.json"]
    assert oci.credentials_for("ghcr.io", configs) == ("me", "pa:ss")
    assert oci.credentials_for("myacr.azurecr.io", configs) == ("00000000-0000", "token")
    assert oci.credentials_for("quay.io", configs) is None


@pytest.mark.process
def test_a_credential_helper_is_asked_as_docker_asks_it(tmp_path, monkeypatch):
    """`credsStore` / `credHelpers` name a `docker-credential-<name>` program on the PATH
    (Docker Desktop, `az acr login`): asked with the registry on stdin."""
    helper = tmp_path / "bin" / "docker-credential-vault"
    helper.parent.mkdir()
    helper.write_text('#!/bin/sh\nread registry\n[ "$1" = get ] && [ "$registry" = '
                      'myacr.azurecr.io ] || exit 1\n'
                      'echo \'{"ServerURL": "myacr.azurecr.io", "Username": "<token>", '
                      '"Secret": "refresh"}\'\n')
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper.parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "config.json").write_text(json.dumps({"credHelpers": {
        "myacr.azurecr.io": "vault"}, "credsStore": "missing-helper"}))
    configs = [tmp_path / "config.json"]
    assert oci.credentials_for("myacr.azurecr.io", configs) == ("<token>", "refresh")
    assert oci.credentials_for("ghcr.io", configs) is None  # its helper is not installed


@pytest.mark.unit
def test_a_registry_that_does_not_answer_is_tried_again_then_named(tmp_path):
    """No registry listens on the port: 4 tries, 2, 4 and 8 s apart, then the reference
    and what to check."""
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    slept: list[float] = []
    said: list[str] = []
    with socket.socket() as taken:  # a port bound but not listening: refused at once
        taken.bind(("127.0.0.1", 0))
        registry = f"127.0.0.1:{taken.getsockname()[1]}"
        reference = oci.Reference.parse(f"oci://{registry}/m/x:v1")
        with pytest.raises(ExportError, match=r"did not answer.*\(4 tries\); check that the "
                           "registry is up"):
            oci.push(folder, reference, plain_http=True, say=said.append, sleep=slept.append)
    assert slept == [2, 4, 8]
    assert said[1:] == [f"  {registry} did not answer (connection refused); trying again in "
                        f"{wait} s" for wait in (2, 4, 8)]  # not urllib3's paragraph


@pytest.mark.unit
def test_a_token_service_that_does_not_answer_is_tried_again_then_named(tmp_path):
    """A registry's Bearer challenge names a token service that is down (its realm): tried
    again as a registry that does not answer is, then named; it raised requests' traceback."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with socket.socket() as taken:  # the token service's port, bound but not listening
        taken.bind(("127.0.0.1", 0))
        realm = f"http://127.0.0.1:{taken.getsockname()[1]}/token"

        class Challenge(BaseHTTPRequestHandler):  # a registry that wants a token for all
            def answer(self) -> None:
                self.send_response(401)
                self.send_header("WWW-Authenticate", f'Bearer realm="{realm}",service="r"')
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_POST = do_PUT = answer

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Challenge)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        registry = f"127.0.0.1:{server.server_address[1]}"
        slept: list[float] = []
        try:
            with pytest.raises(ExportError, match=(
                    rf"the token service of {registry}, {realm}, did not answer \(connection "
                    r"refused\) \(4 tries\); check that the registry is up")):
                oci.push(folder, oci.Reference.parse(f"oci://{registry}/m/x:v1"),
                         plain_http=True, say=lambda _: None, sleep=slept.append)
        finally:
            server.shutdown()
            server.server_close()
    assert slept == [2, 4, 8]


@pytest.mark.unit
def test_a_host_that_does_not_resolve_is_said_at_once_not_tried_again(tmp_path, monkeypatch):
    """A name missing from DNS stays missing: one line naming the host, no retries."""
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    def no_such_name(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)  # the resolver's answer, always
    slept: list[float] = []
    with pytest.raises(ExportError, match=r"^export to registry.example.com:5000/m/x:v1: the "
                       r"registry host registry.example.com does not resolve \(no such name\); "
                       "check the host in the target"):
        oci.push(folder, oci.Reference.parse("oci://registry.example.com:5000/m/x:v1"),
                 say=lambda _: None, sleep=slept.append)
    with pytest.raises(ExportError, match=r"^export to hf://team/x: the hub's host "
                       r"hub.example.com does not resolve \(no such name\); check HF_ENDPOINT"):
        hub.push(folder, hub.HubRepo.parse("hf://team/x"), token="t", say=lambda _: None,
                 sleep=slept.append, endpoint="https://hub.example.com")
    assert slept == []


@pytest.mark.unit
def test_a_hub_that_does_not_answer_is_tried_again_then_named(tmp_path):
    """No hub listens at the endpoint: 4 tries, 2, 4 and 8 s apart, then what to check."""
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    slept: list[float] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(ExportError, match=r"hf://team/x: the hub did not answer "
                           r"\(ConnectError\) \(4 tries\); check that the hub \(HF_ENDPOINT\)"):
            hub.push(folder, hub.HubRepo.parse("hf://team/x"), token="t", say=lambda _: None,
                     sleep=slept.append, endpoint=f"http://127.0.0.1:{taken.getsockname()[1]}")
    assert slept == [2, 4, 8]


@pytest.mark.unit
def test_a_reference_defaults_its_tag():
    assert str(oci.Reference.parse("oci://localhost:5000/a/b")) == "localhost:5000/a/b:latest"
    parsed = oci.Reference.parse("oci://ghcr.io/org/model:2026-11-28")
    assert (parsed.registry, parsed.repository, parsed.tag) == ("ghcr.io", "org/model",
                                                                "2026-11-28")
