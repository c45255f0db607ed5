"""The elastic page budget (adapters/elastic.py): grows in batches, refuses, trims with
hysteresis, and agrees across TP ranks."""

from __future__ import annotations

from kvcached_broker.adapters.elastic import ElasticBudget
from kvcached_broker.client import BrokerClient

from helpers import GIB


def test_elastic_budget_grows_in_batches_refuses_and_trims_with_hysteresis(adapter_broker):
    client = BrokerClient.connect("elastic", endpoint=adapter_broker.endpoint, page_bytes=GIB, credit_pages=0)
    budget = ElasticBudget(client, physical_pages=20, batch_pages=2)
    assert budget.ensure(3) and budget.granted_pages == 5
    assert budget.ensure(5) and budget.granted_pages == 5  # no round trip
    assert budget.ensure(10) and budget.granted_pages == 10  # 12 would not fit on 10 GiB: floor only
    assert not budget.ensure(11) and budget.refusals == 1
    assert budget.trim(used_pages=8) == 0  # within slack: keep
    assert budget.trim(used_pages=3) == 5 and budget.granted_pages == 5
    budget.close()
    assert adapter_broker.status()["granted_bytes"] == 0
    client.close()


def test_elastic_budget_agrees_across_tp_ranks(adapter_broker):
    client = BrokerClient.connect("elastic-tp", endpoint=adapter_broker.endpoint, page_bytes=GIB, credit_pages=0)
    budget = ElasticBudget(client, physical_pages=20, batch_pages=4, reduce_min=lambda v: min(v, 3))
    assert budget.ensure(2) and budget.granted_pages == 3  # another rank got only 3
    assert adapter_broker.ledger.sessions[client.session_id].granted_pages == 3
    client.close()

