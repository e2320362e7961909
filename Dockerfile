# Build: docker build -t firekeeper .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --profile dist -p firekeeper -p relay-sim

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/dist/firekeeper /src/target/dist/relay-sim /usr/local/bin/
USER 65534
ENTRYPOINT ["firekeeper"]
CMD ["run"]
