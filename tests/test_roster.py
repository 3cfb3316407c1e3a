"""Tests of the class roster (course/grading/roster.py) and `python -m course clone`: the format
and its errors, shards that stay put, and cloning from local git repositories made here (a
branch, a tag, a deadline, a missing repository or ref, the token kept off the disk)."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from course.grading import roster as R

ROOT = Path(__file__).resolve().parents[1]
JAN, FEB, MAR = ("2026-01-15T12:00:00+00:00", "2026-02-15T12:00:00+00:00",
                 "2026-03-15T12:00:00+00:00")
TOKEN = "github_pat_FAKE0123456789abcdefTOKEN"


def git(cwd: Path, *args: str, date: str | None = None) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.org",
               GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    if date:
        env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def commit(repo: Path, text: str, date: str) -> str:
    (repo / "work.txt").write_text(text)
    git(repo, "add", "work.txt")
    git(repo, "commit", "-q", "-m", text, date=date)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def forks(tmp_path_factory) -> dict[str, str]:
    """A student repository: main has commits in January and March; branch `submitted` one in
    February on top of January; tag `v1` on January. Returns their paths and commits."""
    root = tmp_path_factory.mktemp("forks")
    repo = root / "fork"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    jan = commit(repo, "january", JAN)
    git(repo, "tag", "v1")
    git(repo, "checkout", "-q", "-b", "submitted")
    feb = commit(repo, "february", FEB)
    git(repo, "checkout", "-q", "main")
    mar = commit(repo, "march", MAR)
    return {"root": str(root), "repo": str(repo), "jan": jan, "feb": feb, "mar": mar}


def roster(tmp_path: Path, text: str) -> list[R.Student]:
    path = tmp_path / "roster.csv"
    path.write_text(text)
    return R.read_roster(path)


# --- the format ---------------------------------------------------------------------------------


def test_rows_comments_optional_columns_and_paths(tmp_path):
    rows = roster(tmp_path, "# a comment\n\nrepository , student\n"
                            "  # another\nada-l/mini_vllm,ada\n./forks/bob,bob\n"
                            "https://git.example.edu/c/m.git,cy\ngit@host.example:d/m.git,dee\n")
    assert [(s.student, s.kind, s.ref, s.login, s.line) for s in rows] == [
        ("ada", "github", "", "", 5), ("bob", "path", "", "", 6), ("cy", "url", "", "", 7),
        ("dee", "url", "", "", 8)]
    assert rows[1].source == str((tmp_path / "forks" / "bob").resolve())  # from the file's folder
    assert rows[0].clone_url("https://github.com") == "https://github.com/ada-l/mini_vllm.git"


def test_the_shipped_example_parses():
    rows = R.read_roster(ROOT / "grading" / "roster.example.csv")
    assert len(rows) == 3 and {s.kind for s in rows} == {"github", "url"}
    assert [s.ref for s in rows] == ["", "submitted", ""]


@pytest.mark.parametrize("text, line, words", [
    ("student,repo\nada,a/b\n", 1, "unknown column 'repo'"),
    ("student,ref\nada,main\n", 1, "no 'repository' column"),
    ("student,repository,student\n", 1, "appears twice"),
    ("student,repository\nada,a/b\nbob,b/c\nAda,c/d\n", 4, "already on line 2"),
    ("student,repository\n../etc,a/b\n", 2, "cannot be a folder name"),
    ("student,repository\nada lovelace,a/b\n", 2, "cannot be a folder name"),
    ("student,repository\n.hidden,a/b\n", 2, "cannot be a folder name"),
    ("student,repository\nx/y,a/b\n", 2, "cannot be a folder name"),
    ("student,repository\n,a/b\n", 2, "student column is empty"),
    ("# c\n# c\nstudent,repository\nada,\n", 4, "no repository for ada"),
    ("student,repository\nada,mini_vllm\n", 2, "not owner/name, a URL or a path"),
    ("student,repository\nada,https://me:tok@github.com/a/b.git\n", 2, "CLASS_TOKEN"),
    ("student,repository\nada,a/b,extra\n", 2, "3 fields"),
    ("student,repository,ref\nada,a/b,--upload-pack=x\n", 2, "not a branch"),
    ("student,repository,ref\nada,a/b,two words\n", 2, "not a branch"),
    ("# only comments\n", None, "no students"),
    ("student,repository\n", None, "no students"),
])
def test_bad_rosters_say_where_and_what_to_do(tmp_path, text, line, words):
    with pytest.raises(R.RosterError) as info:
        roster(tmp_path, text)
    message = str(info.value)
    where = f"roster.csv:{line}: " if line else "roster.csv: "
    assert where in message and words in message, message
    assert "\n" not in message and ";" in message  # one line: what is wrong; what to do
    assert isinstance(info.value, ValueError)


def test_a_missing_roster_file_is_a_roster_error(tmp_path):
    with pytest.raises(R.RosterError, match="cannot read the roster"):
        R.read_roster(tmp_path / "nope.csv")


# --- shards -------------------------------------------------------------------------------------


def test_a_students_shard_depends_on_the_name_only():
    names = [f"student_{i:03d}" for i in range(300)]
    for n in (1, 2, 4, 7):
        alone = {name: R.shard_of(name, n) for name in names}
        shuffled = names[:]
        random.Random(n).shuffle(shuffled)
        rows = [R.Student(s, "o/r", "", "", 0, "github", "o/r") for s in shuffled[:n * 20]]
        for s in rows:  # the same whatever the roster's order and whoever else is in it
            assert R.shard_of(s.student, n) == alone[s.student]
        shards = [{s.student for s in rows if R.in_shard(s.student, (i, n))}
                  for i in range(1, n + 1)]
        assert sum(len(s) for s in shards) == len(rows)  # each in exactly one shard
        assert set().union(*shards) == {s.student for s in rows}
        assert R.plan(rows, n) == {"shard": [i + 1 for i in range(n) if shards[i]]}
    counts = [sum(R.shard_of(s, 4) == k for s in names) for k in range(4)]
    assert min(counts) > 50, counts  # spread out, not all in one
    assert R.shard_of("ada", 4) == R.shard_of("ada", 4) and 0 <= R.shard_of("ada", 4) < 4


def test_parse_shard():
    assert R.parse_shard("1/4") == (1, 4) and R.parse_shard(" 4 / 4 ") == (4, 4)
    for bad in ("0/4", "5/4", "1/0", "4", "a/b", "", "1/257"):
        with pytest.raises(ValueError, match="i/N"):
            R.parse_shard(bad)
    assert R.plan([R.Student("a", "o/r", "", "", 0, "github", "o/r")], 3)["shard"] == [
        R.shard_of("a", 3) + 1]


def test_deadlines_need_their_offset():
    assert R.parse_deadline("2026-05-01T23:59:00+02:00") == datetime(2026, 5, 1, 21, 59,
                                                                       tzinfo=timezone.utc)
    assert R.parse_deadline("2026-05-01T21:59:00Z").tzinfo is not None
    for bad in ("2026-05-01T23:59:00", "2026-05-01", "friday"):
        with pytest.raises(ValueError, match="UTC offset"):
            R.parse_deadline(bad)


# --- cloning ------------------------------------------------------------------------------------


def clone(tmp_path, text, deadline=None, shard=None, **kw):
    rows = roster(tmp_path, text)
    lines = []
    record = R.clone_class(rows, tmp_path / "class", deadline, shard, log=lines.append, **kw)
    assert json.loads((tmp_path / "class" / ".roster.json").read_text()) == record
    return record["students"], lines


def head(path: Path) -> str:
    return git(path, "rev-parse", "HEAD")


def test_clone_refs_and_failures_are_recorded(tmp_path, forks):
    repo = forks["repo"]
    students, lines = clone(tmp_path, f"""student,repository,ref,login
ada,{repo},,ada-gh
bob,{repo},submitted,
cy,{repo},v1,
dee,{repo},{forks['jan']},
eve,{forks['root']}/no-such-repo,,
fay,{repo},no-such-branch,
""")
    klass = tmp_path / "class"
    assert students["ada"] == {"repository": repo, "ref": "", "login": "ada-gh",
                               "commit": forks["mar"], "error": None}
    assert (students["bob"]["commit"], students["cy"]["commit"], students["dee"]["commit"]) == (
        forks["feb"], forks["jan"], forks["jan"])
    for name in ("ada", "bob", "cy", "dee"):
        assert head(klass / name) == students[name]["commit"]
    assert (klass / "bob" / "work.txt").read_text() == "february"  # checked out, not only cloned
    assert students["eve"]["commit"] is None and "could not clone" in students["eve"]["error"]
    assert students["fay"] == {"repository": repo, "ref": "no-such-branch", "login": "",
                               "commit": None,
                               "error": "ref 'no-such-branch' not found (no such branch, tag or "
                                        "commit)"}
    # No folder for a student who was not cloned; every folder is a recorded checkout.
    assert sorted(p.name for p in klass.iterdir()) == [".roster.json", "ada", "bob", "cy", "dee"]
    assert any("eve: NOT CLONED" in line for line in lines)
    assert "\n" not in students["eve"]["error"]


def test_a_deadline_picks_the_last_commit_at_or_before_it(tmp_path, forks):
    repo = forks["repo"]
    text = f"student,repository,ref\nada,{repo},\nbob,{repo},submitted\n"
    students, _ = clone(tmp_path, text, R.parse_deadline("2026-03-01T00:00:00+01:00"))
    assert students["ada"]["commit"] == forks["jan"]  # March is too late; January is the last
    assert students["bob"]["commit"] == forks["feb"]
    assert head(tmp_path / "class" / "ada") == forks["jan"]
    # At the exact commit time, the commit counts; run again into the same folder.
    students, _ = clone(tmp_path, text, datetime.fromisoformat(MAR))
    assert students["ada"]["commit"] == forks["mar"]
    record = json.loads((tmp_path / "class" / ".roster.json").read_text())
    assert record["deadline"] == MAR
    # Nothing before the deadline: recorded, no folder.
    students, _ = clone(tmp_path, text, R.parse_deadline("2025-12-31T23:59:59Z"))
    assert students["ada"]["commit"] is None
    assert "no commit on the default branch at or before the deadline" == students["ada"]["error"]
    assert "submitted" in students["bob"]["error"]
    assert not (tmp_path / "class" / "ada").exists()


def test_only_the_shards_students_are_cloned(tmp_path, forks):
    names = [f"s{i}" for i in range(8)]
    text = "student,repository\n" + "".join(f"{n},{forks['repo']}\n" for n in names)
    students, _ = clone(tmp_path, text, shard=(2, 3))
    assert sorted(students) == sorted(n for n in names if R.shard_of(n, 3) == 1)
    assert json.loads((tmp_path / "class" / ".roster.json").read_text())["shard"] == "2/3"


def test_the_token_never_reaches_the_disk(tmp_path, forks, monkeypatch):
    """An owner/name row, on a stand-in GitHub server (a file:// URL), with CLASS_TOKEN set:
    the clone works and no file under the class folder holds the token in any form."""
    server = tmp_path / "server"
    (server / "ada-l").mkdir(parents=True)
    git(server / "ada-l", "clone", "-q", "--bare", forks["repo"], "mini_vllm.git")
    monkeypatch.setenv("GITHUB_SERVER_URL", server.as_uri())
    monkeypatch.setenv("CLASS_TOKEN", TOKEN)
    students, lines = clone(tmp_path, "student,repository\nada,ada-l/mini_vllm\n"
                                      "bob,ada-l/missing\n")
    assert students["ada"]["commit"] == forks["mar"], students
    assert students["bob"]["error"] and TOKEN not in students["bob"]["error"]
    encoded = base64.b64encode(f"x-access-token:{TOKEN}".encode())
    files = [p for p in (tmp_path / "class").rglob("*") if p.is_file()]
    assert len(files) > 5
    for path in files:
        data = path.read_bytes()
        assert TOKEN.encode() not in data and encoded not in data, path
    assert all(TOKEN not in line for line in lines)
    config = (tmp_path / "class" / "ada" / ".git" / "config").read_text()
    assert f"url = {server.as_uri()}/ada-l/mini_vllm.git" in config


def test_git_runs_without_prompts_and_the_token_only_for_the_server():
    env = R.git_env(TOKEN, "https://github.com")
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    n = int(env["GIT_CONFIG_COUNT"]) - 1
    assert env[f"GIT_CONFIG_KEY_{n}"] == "http.https://github.com/.extraheader"
    header = env[f"GIT_CONFIG_VALUE_{n}"]
    assert base64.b64decode(header.split()[-1]).decode() == f"x-access-token:{TOKEN}"
    assert not any("Authorization" in value for value in R.git_env(None, "x").values())


def test_a_git_command_past_its_time_limit_is_killed(tmp_path):
    env = R.git_env(None, "https://github.com")
    with pytest.raises(R._GitFailed, match="longer than 1 s"):
        R._git(["-c", "alias.hang=!sleep 60", "hang"], tmp_path, env, timeout=1)


def test_clone_refuses_a_folder_it_did_not_make(tmp_path, forks):
    (tmp_path / "class").mkdir()
    (tmp_path / "class" / "precious.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not made by `course clone`"):
        clone(tmp_path, f"student,repository\nada,{forks['repo']}\n")


def test_the_clone_command(tmp_path, forks):
    (tmp_path / "roster.csv").write_text(f"student,repository\nada,{forks['repo']}\n"
                                         f"bob,{forks['repo']}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def course(*args):
        return subprocess.run([sys.executable, "-m", "course", "clone", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)

    proc = course("--roster", "roster.csv", "--plan", "2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"shard": sorted({R.shard_of(n, 2) + 1
                                                        for n in ("ada", "bob")})}
    proc = course("--roster", "roster.csv", "--into", "class", "--shard", "1/1",
                  "--deadline", "2026-02-01T00:00:00Z")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "class" / ".roster.json").read_text())
    assert {n: s["commit"] for n, s in record["students"].items()} == {
        "ada": forks["jan"], "bob": forks["jan"]}
    for args, words in ((("--into", "x", "--shard", "3/2"), "i/N"),
                        (("--into", "x", "--deadline", "tomorrow"), "UTC offset"),
                        (("--plan", "0"), "between 1 and 256"),
                        ((), "--into DIR")):
        proc = course("--roster", "roster.csv", *args)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)
    (tmp_path / "bad.csv").write_text("student,repo\n")
    proc = course("--roster", "bad.csv", "--plan", "2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "bad.csv:1:" in proc.stderr
