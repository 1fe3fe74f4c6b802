# The hybridllm operator (kopf): reconciles LLMService and EdgeFleet objects.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t hybridllm/operator:0.1.0 .
# Only this distribution's dependencies (from uv.lock) are installed.
FROM python:3.11-slim-bookworm AS build

RUN pip install --no-cache-dir uv==0.13.9
ENV UV_PROJECT_ENVIRONMENT=/opt/hybridllm UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy
WORKDIR /src
COPY . .
RUN uv sync --frozen --no-dev --no-editable --package hybridllm-operator

FROM python:3.11-slim-bookworm

COPY --from=build /opt/hybridllm /opt/hybridllm
ENV PATH=/opt/hybridllm/bin:$PATH PYTHONUNBUFFERED=1 HYBRIDLLM_MODEL_CACHE=/var/cache/hybridllm
RUN useradd --uid 10001 --create-home hybridllm && mkdir -p /var/cache/hybridllm && chown hybridllm /var/cache/hybridllm
USER 10001
ENTRYPOINT ["hybridllm-operator"]
