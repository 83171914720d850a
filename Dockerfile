# The image deploy/ refers to as `inference-cache:latest`: the server and the kvevent-subscriber.
#   docker build -t inference-cache:latest .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin inference-cache-server -p inference-cache \
 && cargo build --release --locked -p kvevent-subscriber

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/inference-cache-server /usr/local/bin/
COPY --from=build /src/target/release/kvevent-subscriber /usr/local/bin/
USER 65532:65532
EXPOSE 9090 8080 8081
ENTRYPOINT ["/usr/local/bin/inference-cache-server"]
