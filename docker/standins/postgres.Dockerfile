# A stand-in for the official postgres image where no registry can be
# reached: PostgreSQL from the Debian release's own packages, with the
# official image's layout (binaries on PATH, PGDATA /var/lib/postgresql/data,
# user postgres 999) and start contract (postgres-entrypoint.sh).
# scripts/containers builds it as postgres:<major>-<suite>.
ARG DEBIAN_SUITE=bookworm
FROM debian:${DEBIAN_SUITE}-slim
ARG PG_MAJOR=15
RUN groupadd -r -g 999 postgres \
 && useradd -r -g postgres -u 999 -d /var/lib/postgresql -s /bin/bash postgres \
 && install -d -o postgres -g postgres /var/lib/postgresql \
 && install -d /etc/postgresql-common/createcluster.d \
 && echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/no-main-cluster.conf \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-${PG_MAJOR} \
 && rm -rf /var/lib/apt/lists/*
ENV PG_MAJOR=${PG_MAJOR} \
    PATH=/usr/lib/postgresql/${PG_MAJOR}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data
RUN mkdir /docker-entrypoint-initdb.d
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
STOPSIGNAL SIGINT
EXPOSE 5432
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
