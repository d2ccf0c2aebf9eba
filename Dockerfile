# The servelens image for docker-compose.yml (built once, run by every servelens service) and for Kubernetes:
# the package, its CLI and Dagster's instance file, with dependencies pinned by requirements/image.txt (the
# runtime and the scaleout extra: dagster-postgres, dagster-k8s, dagster-celery; `make lock` writes it).
# Runs as the unprivileged user servelens (uid 10001).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/servelens/dagster DAGSTER_STORAGE_DIR=/data/dagster
WORKDIR /app
# dependencies first, in a layer of their own: rebuilt only when the lock file changes
COPY requirements/image.txt requirements/image.txt
RUN pip install -r requirements/image.txt
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY privacy privacy
COPY pipelines pipelines
COPY replay replay
COPY dashboard dashboard
COPY servelens servelens
COPY deploy/dagster.yaml /opt/servelens/dagster/dagster.yaml
# the package alone (its dependencies are the lock file's); the user; the folders the compose volumes mount
# (a new named volume takes their owner), and $DAGSTER_HOME writable for the small files Dagster keeps there
RUN pip install --no-deps . \
    && useradd --system --uid 10001 --user-group --home-dir /home/servelens --create-home servelens \
    && mkdir -p /data/lake /data/out /data/dagster /data/shared \
    && chown -R servelens:servelens /data \
    && chown servelens:servelens /opt/servelens/dagster
USER servelens
ENTRYPOINT ["servelens"]
