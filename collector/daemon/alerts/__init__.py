"""Alerts: a query's answer rows become alert instances (rules.py), kept through their
lifecycle in the registry's database with a durable outbox of notifications (store.py), and
delivered to Alertmanager and webhooks beside the pipeline (receivers.py, service.py)."""
