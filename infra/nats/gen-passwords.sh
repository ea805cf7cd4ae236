#!/bin/sh
# Print fresh random credentials for the compose stack as a .env file:
#
#   infra/nats/gen-passwords.sh > .env && chmod 600 .env
#
# One NATS password per user of infra/nats/auth.conf (NATS_PASSWORD_<ROLE>), the Ray cluster's auth
# token (RAY_AUTH_TOKEN) and the Grafana admin's password (GRAFANA_ADMIN_PASSWORD). docker compose
# reads .env from the project directory; keep it out of version control and out of images. Add a line
# per tenant you add to auth.conf.
set -eu

secret() {  # $1 random bytes, as hex
    head -c "$1" /dev/urandom | od -An -tx1 | tr -d ' \n'
}

echo "# SJA compose credentials, generated $(date -u +%Y-%m-%dT%H:%M:%SZ). Do not commit."
for role in INVENTORY ADVERTISER CLEARER AGENT EXECUTOR GATEWAY UI ADMIN TENANT_ALPHA TENANT_BETA; do
    echo "NATS_PASSWORD_${role}=$(secret 24)"
done
echo "RAY_AUTH_TOKEN=$(secret 32)"
echo "GRAFANA_ADMIN_PASSWORD=$(secret 16)"
