-- The demo's application transactions: business rows and their events,
-- written together. Run against a database with CREATE EXTENSION pg_outbox.
\set ON_ERROR_STOP on

CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, customer text NOT NULL, total numeric NOT NULL, status text NOT NULL);

-- 1. An order is placed: the row and its event commit together.
BEGIN;
INSERT INTO orders VALUES ('order-1001', 'ada', 42.50, 'placed');
SELECT event_id, aggregate_seq FROM outbox.emit_event('order', 'order-1001', 'OrderPlaced',
    '{"customer": "ada", "total": 42.50}');
COMMIT;

-- 2. A transaction that fails and rolls back: neither the row nor the event exists.
BEGIN;
INSERT INTO orders VALUES ('order-1002', 'bob', 10.00, 'placed');
SELECT event_id, aggregate_seq FROM outbox.emit_event('order', 'order-1002', 'OrderPlaced',
    '{"customer": "bob", "total": 10.00}');
ROLLBACK;

-- 3. Two events of one aggregate in one transaction: sequences 2 and 3.
BEGIN;
UPDATE orders SET status = 'paid' WHERE id = 'order-1001';
SELECT event_id, aggregate_seq FROM outbox.emit_event('order', 'order-1001', 'OrderPaid', '{"amount": 42.50}');
SELECT event_id, aggregate_seq FROM outbox.emit_event('order', 'order-1001', 'OrderShipped', '{"carrier": "post"}');
COMMIT;

-- 4. Another aggregate type goes to its own topic.
BEGIN;
SELECT event_id, aggregate_seq FROM outbox.emit_event('customer', 'ada', 'LoyaltyPointsAdded', '{"points": 42}');
COMMIT;
