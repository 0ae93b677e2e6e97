"""A page's Python session: runs the page's python blocks one after another in one
namespace, as a reader typing them into ``python`` in the page's directory would.

Started by tests/docs/runner.py as ``python child.py REPLY_FD`` with the page's
directory as its working directory. Each request is one JSON line on stdin
(``{"source", "file", "line"}``); each reply one JSON line on REPLY_FD
(``{"ok", "stdout", "error"}``). The block's own output goes to its stdout (kept
in the reply) and stderr (the session's log file).
"""

import contextlib
import io
import json
import os
import sys
import traceback


def main() -> None:
    replies = os.fdopen(int(sys.argv[1]), "w")
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for request_line in sys.stdin:
        request = json.loads(request_line)
        out = io.StringIO()
        reply = {"ok": True, "error": ""}
        try:
            # Padded so that a traceback's line numbers are the page's.
            code = compile("\n" * (request["line"]) + request["source"], request["file"], "exec")
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
        reply["stdout"] = out.getvalue()
        sys.stdout.write(reply["stdout"])
        sys.stdout.flush()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
