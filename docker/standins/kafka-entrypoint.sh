#!/usr/bin/env bash
# Starts one Apache Kafka node in KRaft mode as the apache/kafka image does:
# each KAFKA_* variable is a server setting, named by lower-casing it and
# reading '_' as '.', '__' as '_' and '___' as '-' (KAFKA_NODE_ID is
# node.id); CLUSTER_ID names the cluster; the log directory (KAFKA_LOG_DIRS,
# /var/lib/kafka/data) is formatted at the first start. KAFKA_HEAP_OPTS and
# KAFKA_OPTS go to the JVM.
set -euo pipefail
: "${KAFKA_LOG_DIRS:=/var/lib/kafka/data}"
export KAFKA_LOG_DIRS
props=/opt/kafka/config/server.properties
mkdir -p "$(dirname "$props")" "$KAFKA_LOG_DIRS"
env | sort | while IFS='=' read -r name value; do
    case $name in KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_VERSION) continue ;; KAFKA_*) ;; *) continue ;; esac
    key=${name#KAFKA_}
    key=${key,,}
    key=${key//___/-}
    key=${key//__/@}
    key=${key//_/.}
    printf '%s=%s\n' "${key//@/_}" "$value"
done >"$props"
classpath='/opt/kafka/libs/*'
if [ ! -f "$KAFKA_LOG_DIRS/meta.properties" ]; then
    id=${CLUSTER_ID:-$(java -cp "$classpath" kafka.tools.StorageTool random-uuid | tail -1)}
    java -cp "$classpath" kafka.tools.StorageTool format -t "$id" -c "$props" >/dev/null
fi
# shellcheck disable=SC2086 # the JVM options are lists of flags
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} ${KAFKA_OPTS:-} \
    -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
    -cp "$classpath" kafka.Kafka "$props"
