# A stand-in for the apache/kafka image where no registry can be reached:
# the broker's jars from Maven Central (scripts/kafka/pom.xml, and
# kafka-tools for the health check) on Debian's Java 17, at the official
# image's places (/opt/kafka/libs, /opt/kafka/bin) and with its
# configuration by KAFKA_* variables (kafka-entrypoint.sh).
# scripts/containers assembles the build context and builds it as
# pg-outbox-kafka:<version>.
FROM debian:bookworm-slim
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd -r -g 1000 appuser && useradd -r -g appuser -u 1000 -d /var/lib/kafka appuser \
 && install -d -o appuser -g appuser /var/lib/kafka /opt/kafka/config
COPY libs/ /opt/kafka/libs/
COPY kafka-log4j2.properties /opt/kafka/config/log4j2.properties
COPY kafka-entrypoint.sh /etc/kafka/docker/run
RUN install -d /opt/kafka/bin \
 && printf '#!/bin/sh\nexec java -cp "/opt/kafka/libs/*" org.apache.kafka.tools.BrokerApiVersionsCommand "$@"\n' \
      >/opt/kafka/bin/kafka-broker-api-versions.sh \
 && chmod +x /opt/kafka/bin/kafka-broker-api-versions.sh
USER appuser
EXPOSE 9092
CMD ["/etc/kafka/docker/run"]
