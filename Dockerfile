# kvcached-broker as a container: one broker per GPU, its socket on a shared volume.
#   docker build -t kvcached-broker .
#   docker run -d --gpus device=0 -v kvcached-run:/run/kvcached -v kvcached-state:/var/lib/kvcached-broker \
#       kvcached-broker --device 0

# The wheel, with the request core compiled by mypyc (docs/design.md, "The compiled request
# core"); this stage has the C compiler, the image below does not need one.
FROM python:3.11 AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY broker ./broker
COPY client ./client
COPY adapters ./adapters
COPY tools ./tools
COPY constraints ./constraints
# the build and the install resolve as the tests did (constraints/: make constraints refreshes them)
RUN pip install --no-cache-dir -c constraints/test.txt --upgrade pip \
 && KVCACHED_BROKER_COMPILE=1 pip wheel --no-cache-dir --no-deps --build-constraint constraints/build.txt \
        --wheel-dir /wheels . \
 && cp constraints/test.txt /wheels/constraints.txt

FROM python:3.11-slim

ARG UID=10001
RUN groupadd --system --gid ${UID} kvcached \
 && useradd --system --uid ${UID} --gid kvcached --home-dir /var/lib/kvcached-broker --shell /usr/sbin/nologin kvcached \
 && mkdir -p /run/kvcached /var/lib/kvcached-broker \
 && chown kvcached:kvcached /run/kvcached /var/lib/kvcached-broker \
 && chmod 0750 /run/kvcached && chmod 0700 /var/lib/kvcached-broker

COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir -c /wheels/constraints.txt --upgrade pip \
 && pip install --no-cache-dir -c /wheels/constraints.txt "$(ls /wheels/*.whl)[metrics]" && rm -rf /wheels

ENV KVCACHED_BROKER_RUNTIME_DIR=/run/kvcached \
    KVCACHED_BROKER_STATE_DIR=/var/lib/kvcached-broker \
    PYTHONUNBUFFERED=1
VOLUME ["/run/kvcached", "/var/lib/kvcached-broker"]
USER kvcached
WORKDIR /var/lib/kvcached-broker

# Healthy while the broker answers status on its socket (GPU from KVCACHED_BROKER_DEVICE, default 0).
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["sh", "-c", "kvcached-broker status --device ${KVCACHED_BROKER_DEVICE:-0} > /dev/null"]

ENTRYPOINT ["kvcached-broker", "serve"]
CMD ["--device", "0"]
