"""Records the top-level modules a Python process loads, for tests/test_dependencies.py: on
``PYTHONPATH`` (with ``FLOWSIEVE_IMPORT_AUDIT`` naming a folder) it is imported by every
interpreter of the product's tree, Spark's Python workers included (Spark passes
``PYTHONPATH`` on to them). At every import it appends the top-level names that ``sys.modules``
gained since (an import that failed, a library's ``try: import x``, gains nothing) to
``<folder>/<pid>``, and once more at exit; a forked worker that ends with ``os._exit`` has
written all but its last import by then."""

import atexit
import os
import sys

_FOLDER = os.environ.get("FLOWSIEVE_IMPORT_AUDIT")
if _FOLDER:
    _seen = {name.partition(".")[0] for name in list(sys.modules)}

    def _flush(*_args):
        new = {name.partition(".")[0] for name in list(sys.modules)} - _seen
        if not new:
            return
        _seen.update(new)
        try:
            with open(os.path.join(_FOLDER, str(os.getpid())), "a") as f:
                f.write("".join(f"{name}\n" for name in sorted(new)))
        except OSError:
            pass

    sys.addaudithook(lambda event, args: _flush() if event == "import" else None)
    atexit.register(_flush)
