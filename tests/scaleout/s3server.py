"""moto's S3-compatible server (from PyPI), as the scale-out tests run it: ``python -m tests.scaleout.s3server PORT``.

The same application ``moto_server`` runs, with one difference: requests are applied one at a time.
moto checks ``If-None-Match: *`` and then stores the object in two steps, so two threads could
both pass the check; S3 (and MinIO) make that check and the write one atomic step, which is what
Delta's commit coordination relies on. Connections stay concurrent (a threaded server).
"""

from __future__ import annotations

import signal
import sys
import threading


def main(port: int) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ, start_response):
        with lock:
            return list(app(environ, start_response))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple("127.0.0.1", port, one_at_a_time, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(int(sys.argv[1]))
