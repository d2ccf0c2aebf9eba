# The servelens image for docker-compose.yml: the package and its CLI, nothing else.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY privacy privacy
COPY pipelines pipelines
COPY replay replay
COPY dashboard dashboard
COPY servelens servelens
RUN pip install --no-cache-dir .
ENTRYPOINT ["servelens"]
