# Image for compose.yaml's services (untested here: this machine has no Docker engine).
FROM python:3.11-slim
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY . .
RUN uv sync --frozen --no-dev
ENV PATH="/app/.venv/bin:$PATH"
ENTRYPOINT []
