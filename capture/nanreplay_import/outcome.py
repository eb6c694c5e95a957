"""What the import tells: its notes and warnings, its one error (BadInput names the file and the key),
and the outcome file `nanreplay import` reads them from (NANREPLAY_IMPORT_RESULT). No torch here: the
package reports a missing torch through it."""

import json
import os
import sys

# `nanreplay import` sets this to a file: the helper writes its outcome there (the lines it printed, its
# warnings, or its one error) and leaves printing the error to the command, which prints every command's
# errors the same way (one stderr line, and under --json one object on stdout).
_RESULT_ENV = "NANREPLAY_IMPORT_RESULT"
_outcome = {"notes": [], "warnings": []}


def _write_outcome(extra=None):
    path = os.environ.get(_RESULT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**_outcome, **(extra or {})}, f)
    return bool(path)


def fail(exit_code, kind, what, file=None, key=None):
    """One error, exit_code returned: told to `nanreplay import` through its file, or printed here when run
    alone, as `nanreplay: error: <file>: <key>: <what>`."""
    message = ": ".join(str(p) for p in (file, key, what) if p)
    error = {"exit_code": exit_code, "kind": kind, "message": message, "what": str(what)}
    if file is not None:
        error.update(file=str(file), key=str(key or ""))
    if not _write_outcome({"error": error}):
        print(f"nanreplay: error: {message}", file=sys.stderr, flush=True)
    return exit_code


def warn(text):
    """Something the user should know that does not stop the import: always stderr, never stdout."""
    _outcome["warnings"].append(text)
    print(f"nanreplay: warning: {text}", file=sys.stderr, flush=True)


class BadInput(Exception):
    """Input that cannot make a valid bundle: names the file and the key."""

    def __init__(self, file, key, what):
        super().__init__(f"{file}: {key}: {what}")
        self.file, self.key, self.what = str(file), str(key), str(what)

    def line(self):
        return f"nanreplay: error: {self.file}: {self.key}: {self.what}"


def say(*parts):
    _outcome["notes"].append(" ".join(str(p) for p in parts))
    print(*parts, flush=True)
