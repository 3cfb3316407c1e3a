"""The class roster: who is in the class, where their work lives, and which shard grades them.

``python -m course clone`` reads a roster and clones the students' repositories into a class
folder that ``python -m course grade --class`` grades; the GitHub workflow
(``.github/workflows/grade.yml``) splits the class into shards that grade on separate runners.

The roster is a CSV file (UTF-8, read with the ``csv`` module) whose first row is a header::

    # Lines whose first character (after blanks) is '#' are comments; blank lines are skipped.
    student,repository,ref,login
    ada,ada-l/mini_vllm,,ada-l
    alan,https://git.example.edu/alan/mini_vllm.git,submitted,
    grace,../forks/grace,,

- ``student`` (required): the student's name in every report and the name of the folder their
  work is cloned into. Letters, digits, ``.``, ``_`` and ``-``; it starts with a letter or a
  digit, does not end with ``.`` or ``_`` and has at most 64 characters. Names are unique, also
  when upper and lower case are not told apart (so that no two folders can collide).
- ``repository`` (required): ``owner/name`` for a repository on GitHub (on
  ``$GITHUB_SERVER_URL`` when that is set, as in GitHub Actions), a URL git can clone
  (``https://``, ``ssh://``, ``git://``, ``file://``, ``user@host:path``), or a local path
  starting with ``/``, ``./``, ``../`` or ``~`` (relative paths are taken from the roster
  file's folder). A URL carries no password or token: the token comes from the environment.
- ``ref`` (optional column, may be blank): the branch, tag or commit to grade; blank means the
  repository's default branch.
- ``login`` (optional column, may be blank): the student's account, copied into the records.

Columns may come in any order; a column the format does not know is an error (a typo such as
``repo`` would otherwise be ignored). Any error is a :class:`RosterError` whose message is one
line: ``FILE:LINE: what is wrong; what to do``.

Invariants:

- :func:`shard_of` depends on the student's name and the number of shards only (SHA-256 of the
  name), never on the roster's order or on who else is in it, so a student stays in their shard
  when others join or leave, and every student is in exactly one shard.
- :func:`clone_class` never drops a student of its shard: a failed clone, a missing ref or no
  commit before the deadline is recorded in ``INTO/.roster.json`` with a one-line reason (and no
  folder is left for that student, so every folder in ``INTO`` is a checkout of the recorded
  commit).
- The token (``$CLASS_TOKEN``) is handed to git through its environment (``GIT_CONFIG_*``),
  only for the GitHub server's URLs; it is never put on a command line, in a URL, in
  ``.git/config``, in the records or in a message.
- No git command waits for a password or runs longer than its time limit.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

COLUMNS = ("student", "repository", "ref", "login")
REQUIRED = ("student", "repository")
RECORD = ".roster.json"
GIT_TIMEOUT = 300.0  # seconds, for each git command
MAX_SHARDS = 256  # a GitHub Actions matrix runs at most 256 jobs

_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9-])?")
_GITHUB = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}")
_SCP = re.compile(r"[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:.+")  # user@host:path, as ssh takes it
_URL_SCHEMES = ("https://", "http://", "ssh://", "git://", "file://")
_BAD_REF = re.compile(r"[\s~^:?*\[\\\x00-\x1f\x7f]")


class RosterError(ValueError):
    """A roster that cannot be used; the message is one line naming the file and line."""


@dataclass(frozen=True)
class Student:
    """One row of the roster. ``source`` is what git clones: ``owner/name`` for GitHub
    (``kind == "github"``), the URL as written (``"url"``), or an absolute path (``"path"``)."""

    student: str
    repository: str
    ref: str
    login: str
    line: int
    kind: str
    source: str

    def clone_url(self, server: str) -> str:
        if self.kind == "github":
            name = self.source if self.source.endswith(".git") else self.source + ".git"
            return f"{server.rstrip('/')}/{name}"
        return self.source


# --- reading ------------------------------------------------------------------------------------


def read_roster(path: str | os.PathLike) -> list[Student]:
    """The students of the roster file at ``path``, in file order."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise RosterError(f"{path}: cannot read the roster ({exc.strerror or exc}); give the "
                          "path of a CSV file (see grading/roster.example.csv)") from None
    except UnicodeDecodeError:
        raise RosterError(f"{path}: not UTF-8 text; save the roster as UTF-8 CSV") from None
    return parse_roster(text, source=str(path), base=path.resolve().parent)


def parse_roster(text: str, source: str = "roster", base: Path | None = None) -> list[Student]:
    """Parse roster ``text`` (the format above); ``base`` is where relative paths start
    (default: the current folder). Raises :class:`RosterError`."""
    base = base or Path.cwd()
    # Comment lines become blank lines, so that the csv reader's line numbers stay the file's.
    lines = ["" if line.lstrip().startswith("#") else line for line in text.splitlines()]
    reader = csv.reader(lines, skipinitialspace=True)
    header: list[str] | None = None
    students: list[Student] = []
    seen: dict[str, int] = {}
    try:
        for row in reader:
            where = f"{source}:{reader.line_num}"
            if not any(cell.strip() for cell in row):
                continue
            cells = [cell.strip() for cell in row]
            if header is None:
                header = _header(cells, where)
                continue
            if len(cells) > len(header):
                raise RosterError(f"{where}: {len(cells)} fields but the header has "
                                  f"{len(header)}; quote a value that holds a comma")
            fields = dict(zip(header, cells + [""] * (len(header) - len(cells))))
            student = _student(fields, where, reader.line_num, base)
            key = student.student.lower()
            if key in seen:
                raise RosterError(f"{where}: student {student.student!r} is already on line "
                                  f"{seen[key]}; give each student one row and a unique name")
            seen[key] = reader.line_num
            students.append(student)
    except csv.Error as exc:
        raise RosterError(f"{source}:{reader.line_num}: not valid CSV ({exc}); check the "
                          "quotes on this line") from None
    if header is None or not students:
        raise RosterError(f"{source}: no students; write the header "
                          f"'{','.join(COLUMNS)}' and one row per student")
    return students


def _header(cells: list[str], where: str) -> list[str]:
    names = [c.lower() for c in cells]
    for name in names:
        if name not in COLUMNS:
            raise RosterError(f"{where}: unknown column {name!r}; the columns are "
                              f"{', '.join(COLUMNS)} (ref and login may be left out)")
        if names.count(name) > 1:
            raise RosterError(f"{where}: column {name!r} appears twice; keep one")
    for name in REQUIRED:
        if name not in names:
            raise RosterError(f"{where}: the header has no {name!r} column; the first "
                              f"non-comment line must be a header such as "
                              f"'{','.join(COLUMNS)}'")
    return names


def _student(fields: dict[str, str], where: str, line: int, base: Path) -> Student:
    name = fields["student"]
    if not name:
        raise RosterError(f"{where}: the student column is empty; give every row a name")
    if not _NAME.fullmatch(name):
        raise RosterError(
            f"{where}: student name {name!r} cannot be a folder name; use letters, digits, "
            "'.', '_' and '-' (at most 64, starting with a letter or digit, e.g. ada_lovelace)")
    repo = fields["repository"]
    if not repo:
        raise RosterError(f"{where}: no repository for {name}; give owner/name, a URL or a path")
    kind, src = _repository(repo, where, base)
    ref = fields.get("ref", "")
    if ref and (ref.startswith("-") or _BAD_REF.search(ref)):
        raise RosterError(f"{where}: ref {ref!r} is not a branch, tag or commit name; leave it "
                          "blank for the default branch")
    login = fields.get("login", "")
    if any(ord(c) < 32 for c in login):
        raise RosterError(f"{where}: login {login!r} holds a control character; remove it")
    return Student(name, repo, ref, login, line, kind, src)


def _repository(repo: str, where: str, base: Path) -> tuple[str, str]:
    if repo.startswith(_URL_SCHEMES):
        parts = urlsplit(repo)
        if parts.password or (parts.username and parts.scheme in ("http", "https")):
            raise RosterError(f"{where}: the URL holds a user name or token; write it without "
                              "one and put the token in the CLASS_TOKEN secret instead")
        return "url", repo
    if repo.startswith(("/", "./", "../", "~")):
        return "path", str((base / Path(repo).expanduser()).resolve())
    if _SCP.fullmatch(repo):
        return "url", repo
    if _GITHUB.fullmatch(repo):
        return "github", repo
    raise RosterError(f"{where}: repository {repo!r} is not owner/name, a URL or a path; write "
                      "owner/name for GitHub, a full URL, or a path starting with / ./ or ../")


# --- shards -------------------------------------------------------------------------------------


def shard_of(student: str, shards: int) -> int:
    """The 0-based shard of ``student`` among ``shards``: the SHA-256 of the name modulo
    ``shards`` (stable across rosters, runs and machines)."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    digest = hashlib.sha256(student.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` (1-based ``i``, ``1 <= i <= N``) as ``(i, N)``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if match:
        i, n = int(match[1]), int(match[2])
        if 1 <= i <= n <= MAX_SHARDS:
            return i, n
    raise ValueError(f"shard {text!r}: write i/N with 1 <= i <= N <= {MAX_SHARDS} (e.g. 2/4 for "
                     "the second of four shards)")


def in_shard(student: str, shard: tuple[int, int] | None) -> bool:
    """Whether ``student`` belongs to ``shard`` (``(i, N)``, 1-based); every student belongs
    to ``None`` (no sharding)."""
    return shard is None or shard_of(student, shard[1]) == shard[0] - 1


def plan(students: Iterable[Student], shards: int) -> dict[str, list[int]]:
    """The GitHub Actions matrix for ``shards`` shards: ``{"shard": [i, ...]}``, the 1-based
    shards that hold at least one student (an empty shard would have nothing to grade)."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards: {shards} is not between 1 and {MAX_SHARDS}")
    return {"shard": sorted({shard_of(s.student, shards) + 1 for s in students})}


# --- cloning ------------------------------------------------------------------------------------


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 time with its UTC offset (``2026-05-01T23:59:00+02:00``, or ``Z``)."""
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise ValueError(f"deadline {text!r}: write an ISO 8601 time with its UTC offset, e.g. "
                         "2026-05-01T23:59:00+02:00 or 2026-05-01T21:59:00Z")
    return when


class _GitFailed(Exception):
    pass


def git_env(token: str | None, server: str) -> dict[str, str]:
    """The environment of every git command: never prompt (a private repository without a
    token fails instead of waiting), and, with a token, an ``Authorization`` header for the
    GitHub server's URLs only, given as ``GIT_CONFIG_*`` variables (not on the command line,
    where other users could read it, and not in ``.git/config``)."""
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GCM_INTERACTIVE="never", LC_ALL="C",
               GIT_SSH_COMMAND="ssh -o BatchMode=yes")
    if token:
        n = int(env.get("GIT_CONFIG_COUNT") or 0)
        basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
        env.update({
            "GIT_CONFIG_COUNT": str(n + 1),
            f"GIT_CONFIG_KEY_{n}": f"http.{server.rstrip('/')}/.extraheader",
            f"GIT_CONFIG_VALUE_{n}": f"Authorization: Basic {basic}",
        })
    return env


def _git(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run git; its stdout, or :class:`_GitFailed` with git's last error line. The whole
    process group (git and its helpers) is killed at the time limit."""
    proc = subprocess.Popen(["git", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        raise _GitFailed(f"git {args[0]} took longer than {timeout:g} s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
        fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
        last = (fatal or lines or [f"git {args[0]} exited {proc.returncode}"])[-1]
        raise _GitFailed(re.sub(r"^(fatal|error): ", "", last)[:300])
    return out


def _strip_credentials(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and (parts.username or parts.password):
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _clone_one(st: Student, dest: Path, url: str, before: str | None, env: dict[str, str],
               timeout: float) -> tuple[str | None, str | None]:
    """Clone ``st`` into ``dest``: ``(commit, None)``, or ``(None, reason)`` with ``dest``
    removed."""
    shutil.rmtree(dest, ignore_errors=True)
    step = "clone"
    try:
        # Blob-less partial clone: every commit and tree (so that the deadline can be looked up
        # locally), file contents only for the commit checked out. A shallow clone could not
        # look back past its tip.
        _git(["clone", "--quiet", "--no-checkout", "--filter=blob:none", "--", url, str(dest)],
             dest.parent, env, timeout)
        step = "ref"
        candidates = ([f"refs/remotes/origin/{st.ref}", f"refs/tags/{st.ref}", st.ref]
                      if st.ref else ["HEAD"])
        commit = None
        for cand in candidates:
            try:
                commit = _git(["rev-parse", "--verify", "--quiet", f"{cand}^{{commit}}"],
                              dest, env, timeout).strip()
                break
            except _GitFailed:
                continue
        if not commit:
            raise _GitFailed(f"ref {st.ref!r} not found (no such branch, tag or commit)"
                             if st.ref else "the repository has no commits")
        if before is not None:
            step = "deadline"
            commit = _git(["rev-list", "-1", f"--before={before}", commit, "--"],
                          dest, env, timeout).strip()
            if not commit:
                raise _GitFailed(f"no commit on {st.ref or 'the default branch'} at or before "
                                 "the deadline")
        step = "checkout"
        _git(["checkout", "--quiet", "--detach", commit], dest, env, timeout)
        for remote in _git(["remote"], dest, env, timeout).split():
            remote_url = _git(["remote", "get-url", remote], dest, env, timeout).strip()
            if _strip_credentials(remote_url) != remote_url:
                _git(["remote", "set-url", remote, _strip_credentials(remote_url)], dest, env,
                     timeout)
        return commit, None
    except (_GitFailed, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        what = {"clone": "could not clone", "ref": "could not find the ref",
                "deadline": "could not apply the deadline",
                "checkout": "could not check out"}[step]
        plain = isinstance(exc, _GitFailed) and step in ("ref", "deadline")
        reason = str(exc) if plain else f"{what}: {exc}"
        return None, reason


def clone_class(
    roster_rows: Iterable[Student],
    into: Path,
    deadline: datetime | None,
    shard: tuple[int, int] | None = None,
    token_env: str = "CLASS_TOKEN",
    log: Callable[[str], None] = print,
    jobs: int = 4,
    timeout: float = GIT_TIMEOUT,
) -> dict:
    """Clone the students of ``shard`` (all without one) into ``into/<student>``, each at its
    ref (the default branch when blank) and, with ``deadline``, at the ref's last commit at or
    before it (by commit date). Writes and returns the record ``into/.roster.json``::

        {"deadline": ISO or null, "shard": "i/N" or null,
         "students": {name: {"repository", "ref", "login", "commit": sha or null,
                             "error": one-line reason or null}}}

    ``into`` must be new, empty, or a folder this function made before (it holds the record);
    a student's existing folder is replaced.
    """
    into = Path(into).resolve()
    if into.exists() and any(into.iterdir()) and not (into / RECORD).is_file():
        raise FileExistsError(f"{into} is not empty and was not made by `course clone`; give a "
                              "new folder to --into")
    into.mkdir(parents=True, exist_ok=True)
    mine = [s for s in roster_rows if in_shard(s.student, shard)]
    server = os.environ.get("GITHUB_SERVER_URL") or "https://github.com"
    token = os.environ.get(token_env) or None
    env = git_env(token, server)
    before = None
    if deadline is not None:
        before = deadline.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S +0000")

    def hide(text: str | None) -> str | None:
        if text and token:
            text = text.replace(token, "***")
        return text

    def one(st: Student) -> tuple[Student, str | None, str | None]:
        commit, error = _clone_one(st, into / st.student, st.clone_url(server), before, env,
                                   timeout)
        error = hide(error)
        log(f"{st.student}: {commit[:12]}" if commit else f"{st.student}: NOT CLONED: {error}")
        return st, commit, error

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(one, mine))
    record = {
        "deadline": deadline.isoformat() if deadline else None,
        "shard": f"{shard[0]}/{shard[1]}" if shard else None,
        "students": {
            st.student: {"repository": st.repository, "ref": st.ref, "login": st.login,
                         "commit": commit, "error": error}
            for st, commit, error in sorted(done, key=lambda d: d[0].student)
        },
    }
    tmp = into / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(into / RECORD)
    failed = sum(1 for _, commit, _ in done if commit is None)
    log(f"cloned {len(done) - failed} of {len(done)} student(s) into {into}"
        + (f"; {failed} not cloned (reasons in {into / RECORD})" if failed else ""))
    return record
