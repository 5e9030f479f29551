"""Retail and airline tool-use environments with verifiable rewards, in the style of tau-bench.

What: two procedurally generated domains (a database, tools over it with OpenAI JSON schemas, a short policy) and
tasks from 12 scenarios in three tiers: a brief for a simulated user (persona, request, facts revealed only when
asked) plus an oracle's gold actions. Env(task) gives every rollout a fresh database; score() is computed once at the
end: reward 1.0 iff the final database equals the gold replay's AND the agent said every required output AND the
conversation ended rather than being cut off at the turn cap (τ²'s rule), and what was wrong, field by field.

Run:   python -m envs.ours         # tour: a task, tools, policy, oracle replays, prompt tokens
Test:  pytest tests/test_envs.py

Simplifications versus tau-bench: small catalogues and compact records (a 135M model reads them); a reservation
is one direct one-way flight, with no flight status; all tool parameters are required; "today" is fixed. Policy
asks for authentication and confirmation, checked only through the outcome; the tools enforce state rules (order
status, insurance, seats, balances) as errors.
"""
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from envs.databases import AIRPORTS, CABINS, DATES, INSURANCE_FEE, TODAY, address, load_db, money

DOMAINS = ("retail", "airline")
ENDED = ("user_stop", "transfer", "agent_stop")   # a conversation that ended itself; the rest were cut short
REASONS = {"no longer needed": "I no longer need it", "ordered by mistake": "I ordered it by mistake"}  # cancel



@dataclass
class Action:
    name: str
    arguments: dict


def act(name, **arguments):
    return Action(name, arguments)


@dataclass
class Task:
    id: str                        # "retail-train-00042"
    domain: str
    split: str
    scenario: str
    tier: str                      # easy | medium | hard
    instruction: str               # brief for an LLM user simulator
    opening: str                   # the user's first message (identifiers only in the easy tier)
    hidden_facts: dict             # FACT_KEYWORDS key -> value the user reveals when asked
    gold_actions: list             # the oracle's lookups and writes, in order
    required_outputs: list         # strings some assistant message must contain
    confirm_terms: list            # per gold write: {fact key: value (or [alternatives]) its confirmation must name}
    seed: int = 0                  # the DB seed: load_db(domain, split, seed)
    rivals: dict = field(default_factory=dict)   # fact key -> the wrong values of its kind (other reasons, cards)


class ToolError(Exception):
    """A refused tool call; Env.step turns it into an "Error: ..." observation."""


# ----------------------------------------------------------------------------- tools: registry, shared helpers
S, I, B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
IDS = {"type": "array", "items": S}
PASSENGERS = {"type": "array", "items": {"type": "object", "properties": {
    "first_name": S, "last_name": S, "dob": S}, "required": ["first_name", "last_name", "dob"]}}
ADDRESS = {"address1": S, "city": S, "state": S, "zip": S}
TOOLS = {d: {} for d in DOMAINS}              # domain -> tool name -> (function, OpenAI schema)
WRITE_TOOLS = {d: set() for d in DOMAINS}     # domain -> names of the tools that change the DB

def tool(domains, description, write=False, **params):
    """Register a function as a tool of each domain; params: name=JSON schema (all required)."""
    def register(fn):
        schema = {"type": "function", "function": {"name": fn.__name__, "description": description, "parameters": {
            "type": "object", "properties": params, "required": list(params)}}}
        for d in domains.split():
            TOOLS[d][fn.__name__] = (fn, schema)
            WRITE_TOOLS[d] |= {fn.__name__} if write else set()
        return fn
    return register

def tool_schemas(domain):
    return [schema for _, schema in TOOLS[domain].values()]

def _short(x, n=40):
    return repr(x)[:n] + "..." * (len(repr(x)) > n)

_TYPES = {"string": ("a short string", lambda v: isinstance(v, str) and 0 < len(v) <= 200),
          "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1000),
          "boolean": ("a boolean", lambda v: isinstance(v, bool)),
          "array": ("a short list", lambda v: isinstance(v, list) and len(v) <= 10),
          "object": ("an object", lambda v: isinstance(v, dict))}

def _check(value, schema, path="arguments"):
    """Validate a value against our JSON-schema subset; raise ToolError naming the bad field."""
    kind, ok = _TYPES[schema["type"]]
    if not ok(value):
        raise ToolError(f"{path} must be {kind}, got {_short(value)}")
    if value not in schema.get("enum", [value]):
        raise ToolError(f"{path} must be one of {schema['enum']}")
    for i, v in enumerate(value if schema["type"] == "array" else []):
        _check(v, schema["items"], f"{path}[{i}]")
    if schema["type"] == "object":
        if set(value) != set(schema["properties"]):                   # every field is required, none is extra
            raise ToolError(f"{path} needs exactly {sorted(schema['properties'])}, got {_short(list(value), 60)}")
        for k, v in value.items():
            _check(v, schema["properties"][k], k if path == "arguments" else f"{path}.{k}")

def _get(table, key, what, status=None):
    """table[key], which must exist and, if status is given, be in it (e.g. a pending order)."""
    if key not in table:
        raise ToolError(f"{what} {_short(key)} not found")
    if status and table[key]["status"] != status:
        raise ToolError(f"{what} {key} is {table[key]['status']}; only {status} {what}s allow this")
    return table[key]

def _pay(db, record, pm_id, amount, dry_run=False):
    """Charge (amount > 0) or refund (amount < 0) the user's pm_id for a record (order or reservation).
    Gift cards and certificates must cover a charge. dry_run: only check."""
    amount, pm = money(amount), _get(db["users"][record["user_id"]]["payment_methods"], pm_id, "payment method")
    if "balance" in pm and amount > pm["balance"]:
        raise ToolError(f"{pm_id} balance {pm['balance']} is less than {amount}")
    if amount and not dry_run:
        if "balance" in pm:
            pm["balance"] = money(pm["balance"] - amount)
        record["payment_history"].append(
            {"type": "payment" if amount > 0 else "refund", "amount": abs(amount), "payment_method_id": pm_id})
    return pm

def _refund_all(db, record):
    held = {}                                     # payment method -> amount paid, net of refunds
    for p in record["payment_history"]:
        sign = 1 if p["type"] == "payment" else -1
        held[p["payment_method_id"]] = held.get(p["payment_method_id"], 0) + sign * p["amount"]
    for pm_id, amount in held.items():
        _pay(db, record, pm_id, -max(amount, 0))

@tool("retail airline", "Evaluate arithmetic like '2*(3.5+1)'.", expression=S)
def calculate(db, expression):
    if not re.fullmatch(r"[\d\s.+\-*/()]+", expression) or "**" in expression:   # plain arithmetic only
        raise ToolError("only numbers, + - * / and parentheses are allowed")
    try:
        return str(round(eval(expression, {"__builtins__": {}}), 2))
    except (SyntaxError, ArithmeticError, TypeError, ValueError, MemoryError, RecursionError):
        raise ToolError(f"cannot evaluate {_short(expression)}")

@tool("retail airline", "Hand the conversation to a human agent.", summary=S)
def transfer_to_human_agents(db, summary):
    return "Transfer successful."

@tool("retail airline", "Get a user's profile, payment methods and orders or reservations.", user_id=S)
def get_user_details(db, user_id):
    return _get(db["users"], user_id, "user")


# ----------------------------------------------------------------------------- retail tools
@tool("retail", "Find a user id by email.", email=S)
def find_user_id_by_email(db, email):
    return _get({u["email"]: u["user_id"] for u in db["users"].values()}, email.strip().lower(), "user with email")

@tool("retail", "Find a user id by name and zip.", first_name=S, last_name=S, zip=S)
def find_user_id_by_name_zip(db, first_name, last_name, zip):
    users = {(u["name"].lower(), u["address"]["zip"]): u["user_id"] for u in db["users"].values()}
    return _get(users, (f"{first_name} {last_name}".lower(), zip.strip()), "user with name and zip")

@tool("retail", "Get an order's status, items, address and payments.", order_id=S)
def get_order_details(db, order_id):
    return _get(db["orders"], order_id, "order")

@tool("retail", "Get a product's variants: item ids, options, prices, availability.", product_id=S)
def get_product_details(db, product_id):
    return _get(db["products"], product_id, "product")

def _item_indices(order, item_ids):
    owned = [i["item_id"] for i in order["items"]]
    if not item_ids or len(set(item_ids)) != len(item_ids) or any(i not in owned for i in item_ids):
        raise ToolError(f"item_ids must be distinct items of order {order['order_id']}")
    return [owned.index(i) for i in item_ids]

def _swap_items(db, order, item_ids, new_item_ids):
    """Check a swap of items for other available variants of the same product: [(index, variant)], price change."""
    if len(item_ids) != len(new_item_ids):
        raise ToolError("item_ids and new_item_ids must have the same length")
    swaps = [(i, db["products"][order["items"][i]["product_id"]]["variants"].get(new))
             for i, new in zip(_item_indices(order, item_ids), new_item_ids)]
    if any(v is None or v["item_id"] in item_ids or not v["available"] for _, v in swaps):
        raise ToolError("each new item must be another available variant of the same product")
    return swaps, money(sum(v["price"] - order["items"][i]["price"] for i, v in swaps))

@tool("retail", "Cancel a pending order.", write=True, order_id=S, reason={"type": "string", "enum": list(REASONS)})
def cancel_pending_order(db, order_id, reason):
    order = _get(db["orders"], order_id, "order", "pending")
    _refund_all(db, order)
    order.update(status="cancelled", cancel_reason=reason)
    return order

@tool("retail", "Change a pending order's shipping address.", write=True, order_id=S, **ADDRESS)
def modify_pending_order_address(db, order_id, **address):
    _get(db["orders"], order_id, "order", "pending")["address"] = address
    return db["orders"][order_id]

@tool("retail", "Swap items of a pending order for other variants.", write=True,
      order_id=S, item_ids=IDS, new_item_ids=IDS, payment_method_id=S)
def modify_pending_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    order = _get(db["orders"], order_id, "order", "pending")
    swaps, delta = _swap_items(db, order, item_ids, new_item_ids)
    _pay(db, order, payment_method_id, delta)
    for i, v in swaps:
        order["items"][i].update(item_id=v["item_id"], options=v["options"], price=v["price"])
    return order

@tool("retail", "Pay a pending order with another payment method.", write=True, order_id=S, payment_method_id=S)
def modify_pending_order_payment(db, order_id, payment_method_id):
    order = _get(db["orders"], order_id, "order", "pending")
    old = [p for p in order["payment_history"] if p["type"] == "payment"][-1]["payment_method_id"]
    if payment_method_id == old:
        raise ToolError("the new payment method must differ from the current one")
    _pay(db, order, payment_method_id, sum(i["price"] for i in order["items"]))     # checks, then charges
    _pay(db, order, old, -sum(i["price"] for i in order["items"]))                  # a refund cannot fail
    return order

@tool("retail", "Return items of a delivered order.", write=True, order_id=S, item_ids=IDS, payment_method_id=S)
def return_delivered_order_items(db, order_id, item_ids, payment_method_id):
    order = _get(db["orders"], order_id, "order", "delivered")
    _item_indices(order, item_ids)
    pm = _pay(db, order, payment_method_id, 0)
    if payment_method_id != order["payment_history"][0]["payment_method_id"] and pm["type"] != "gift_card":
        raise ToolError("refunds go to the original payment method or a gift card")
    order.update(status="return requested", return_items=sorted(item_ids), return_payment_method_id=payment_method_id)
    return order

@tool("retail", "Exchange items of a delivered order for other variants.", write=True,
      order_id=S, item_ids=IDS, new_item_ids=IDS, payment_method_id=S)
def exchange_delivered_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    order = _get(db["orders"], order_id, "order", "delivered")
    _, delta = _swap_items(db, order, item_ids, new_item_ids)
    _pay(db, order, payment_method_id, delta, dry_run=True)      # charged when the exchange is processed
    order.update(status="exchange requested", exchange_items=item_ids, exchange_new_items=new_item_ids,
                 exchange_payment_method_id=payment_method_id, exchange_price_difference=delta)
    return order

@tool("retail", "Change a user's default address.", write=True, user_id=S, **ADDRESS)
def modify_user_address(db, user_id, **address):
    _get(db["users"], user_id, "user")["address"] = address
    return db["users"][user_id]


# ----------------------------------------------------------------------------- airline tools
BAG_FEE = 50

@tool("airline", "Get a reservation's flight, passengers, bags and payments.", reservation_id=S)
def get_reservation_details(db, reservation_id):
    return _get(db["reservations"], reservation_id, "reservation")

@tool("airline", "Direct flights on a date (YYYY-MM-DD): prices, free seats.", origin=S, destination=S, date=S)
def search_direct_flight(db, origin, destination, date):
    found = [dict(flight_number=f["flight_number"], depart=f["depart"], **f["dates"][date])
             for f in db["flights"].values() if (f["origin"], f["destination"]) == (origin, destination)
             and date in f["dates"]]
    return found or "No direct flights on that route and date."

def _flight_day(db, flight_number, date, cabin, seats):
    """The flight's entry on date, checked to be in the future with enough free seats in cabin."""
    day = _get(_get(db["flights"], flight_number, "flight")["dates"], date, f"date for {flight_number}")
    if date <= TODAY or day["seats"][cabin] < seats:
        raise ToolError(f"{flight_number} on {date} is in the past or has fewer than {seats} free {cabin} seats")
    return day

def _bag_fee(db, res, bags):
    """BAG_FEE per bag beyond the free ones: per passenger 1 in economy, 2 in business, +1 for gold members."""
    per_passenger = {"economy": 1, "business": 2}[res["cabin"]] + (db["users"][res["user_id"]]["membership"] == "gold")
    return BAG_FEE * max(0, bags - len(res["passengers"]) * per_passenger)

@tool("airline", "Book a one-way direct flight.", write=True, user_id=S, flight_number=S, date=S,
      cabin={"type": "string", "enum": CABINS}, passengers=PASSENGERS, payment_method_id=S, insurance=B,
      total_baggages=I)
def book_reservation(db, user_id, flight_number, date, cabin, passengers, payment_method_id, insurance, total_baggages):
    user = _get(db["users"], user_id, "user")
    if not 1 <= len(passengers) <= 5 or not 0 <= total_baggages <= 10:
        raise ToolError("need 1-5 passengers and 0-10 bags")
    day, flight = _flight_day(db, flight_number, date, cabin, len(passengers)), db["flights"][flight_number]
    res = dict(reservation_id=f"NEW{len(db['reservations']):03d}", user_id=user_id, origin=flight["origin"],
               destination=flight["destination"], flight_number=flight_number, date=date, cabin=cabin,
               passengers=passengers, insurance=insurance, total_baggages=total_baggages, status="active",
               payment_history=[])          # the id is deterministic, so the agent's run and the gold replay agree
    fare = len(passengers) * (day["prices"][cabin] + INSURANCE_FEE * insurance)
    _pay(db, res, payment_method_id, fare + _bag_fee(db, res, total_baggages))
    day["seats"][cabin] -= len(passengers)
    db["reservations"][res["reservation_id"]] = res
    user["reservations"].append(res["reservation_id"])
    return res

@tool("airline", "Cancel a reservation and refund it.", write=True, reservation_id=S)
def cancel_reservation(db, reservation_id):
    res = _get(db["reservations"], reservation_id, "reservation", "active")
    if not (res["insurance"] or res["cabin"] == "business"):
        raise ToolError("only reservations with travel insurance or in business cabin can be cancelled")
    _refund_all(db, res)
    db["flights"][res["flight_number"]]["dates"][res["date"]]["seats"][res["cabin"]] += len(res["passengers"])
    res["status"] = "cancelled"
    return res

@tool("airline", "Raise a reservation's total checked bags.", write=True,
      reservation_id=S, total_baggages=I, payment_method_id=S)
def update_reservation_baggages(db, reservation_id, total_baggages, payment_method_id):
    res = _get(db["reservations"], reservation_id, "reservation", "active")
    if not res["total_baggages"] < total_baggages <= 10:
        raise ToolError(f"total_baggages must be above the current {res['total_baggages']} and at most 10")
    _pay(db, res, payment_method_id, _bag_fee(db, res, total_baggages) - _bag_fee(db, res, res["total_baggages"]))
    res["total_baggages"] = total_baggages
    return res

@tool("airline", "Move a reservation to another flight or date on the same route.", write=True,
      reservation_id=S, flight_number=S, date=S, payment_method_id=S)
def update_reservation_flights(db, reservation_id, flight_number, date, payment_method_id):
    res = _get(db["reservations"], reservation_id, "reservation", "active")
    n, cabin = len(res["passengers"]), res["cabin"]
    new, flight = _flight_day(db, flight_number, date, cabin, n), db["flights"][flight_number]
    if (flight["origin"], flight["destination"]) != (res["origin"], res["destination"]) \
            or (flight_number, date) == (res["flight_number"], res["date"]):
        raise ToolError("the new flight must differ and have the same origin and destination")
    old = db["flights"][res["flight_number"]]["dates"][res["date"]]
    _pay(db, res, payment_method_id, n * (new["prices"][cabin] - old["prices"][cabin]))
    old["seats"][cabin], new["seats"][cabin] = old["seats"][cabin] + n, new["seats"][cabin] - n
    res.update(flight_number=flight_number, date=date)
    return res

@tool("airline", "Correct passenger names or dates of birth.", write=True, reservation_id=S, passengers=PASSENGERS)
def update_reservation_passengers(db, reservation_id, passengers):
    res = _get(db["reservations"], reservation_id, "reservation", "active")
    if len(passengers) != len(res["passengers"]):
        raise ToolError(f"the reservation has {len(res['passengers'])} passengers")
    res["passengers"] = passengers
    return res

@tool("airline", "Give a user a travel certificate (amount 1-500).", write=True, user_id=S, amount=I)
def send_certificate(db, user_id, amount):
    pms = _get(db["users"], user_id, "user")["payment_methods"]
    if not 1 <= amount <= 500:
        raise ToolError("amount must be 1-500")
    pm_id = f"certificate_{len(pms) + 1}"
    pms[pm_id] = dict(id=pm_id, type="certificate", balance=float(amount))
    return f"Certificate {pm_id} of {amount} added."

POLICIES = {
    "retail": f"""You are a customer service agent for an online shop. Today is {TODAY}.
- First authenticate the user: find their user id by email, or by name and zip. Then help only that user with their own orders.
- Look things up with tools; never guess ids, prices or options. Make at most one tool call per message.
- Before any change (cancel, modify, return, exchange, address update) state the order id, the items or new values and the payment method, and ask the user to confirm. Act only after an explicit yes.
- Only pending orders can be cancelled or modified (shipping address, payment method, items). Cancel reasons: "no longer needed" or "ordered by mistake". Cancelling refunds the original payment.
- Item changes and exchanges: an item can only become another available variant of the same product (see get_product_details). The price difference is charged or refunded via a payment method the user picks.
- A new payment method must differ from the current one; a gift card needs enough balance.
- Only delivered orders can be returned or exchanged. Refunds go to the original payment method or a gift card.
- If a request breaks a rule, refuse and say why, naming the order status (e.g. delivered).
- When asked about an order, give its status and total exactly as the tool shows them.
- Transfer to a human agent only if your tools cannot handle the request.""",
    "airline": f"""You are an airline customer service agent. Today is {TODAY}.
- First get the user id and look the user up. Help only that user with their own reservations.
- Look things up with tools; never guess ids, flights or prices. Make at most one tool call per message.
- Before any change (booking, cancellation, flight change, bags, passengers) state the reservation or flight, the new values and the payment method, and ask the user to confirm. Act only after an explicit yes.
- Booking: one-way direct flights, one cabin (economy or business) for all 1-5 passengers, paid with one payment method of the user. Travel insurance costs {INSURANCE_FEE} per passenger. Gift cards and certificates need enough balance.
- Checked bags: free per passenger 1 in economy, 2 in business, plus 1 for gold members. Each extra bag costs {BAG_FEE}. Bags can be added, never removed.
- Flight change: to another flight or date with the same origin, destination and cabin. The fare difference for all passengers is charged or refunded via a payment method of the user.
- Passenger names and dates of birth can be corrected; the number of passengers cannot change.
- Cancellation: only if the reservation has travel insurance or is in business cabin; all payments are refunded. Otherwise refuse and explain that it has no insurance.
- Certificates need a supervisor: transfer complaints to a human agent.""",
}


# ----------------------------------------------------------------------------- scenarios and tasks
SCENARIOS = {d: {} for d in DOMAINS}         # domain -> scenario name -> builder(rng, db) -> dict of task parts

def scenario(domain, name):
    return lambda builder: SCENARIOS[domain].setdefault(name, builder)

def _retail(rng, db, status, pred=lambda o: True):
    """A random order in status, its user, the facts that identify both, and the oracle's two lookups."""
    o = rng.choice([o for o in db["orders"].values() if o["status"] == status and pred(o)])
    u = db["users"][o["user_id"]]
    facts = {"email": u["email"], "name": u["name"], "zip": u["address"]["zip"], "order_id": o["order_id"]}
    return o, u, facts, [act("find_user_id_by_email", email=u["email"]),
                         act("get_order_details", order_id=o["order_id"])]

def _airline(rng, db, pred=lambda r: True):
    """A random active reservation, its user and credit card, the identifying facts, the oracle's two lookups."""
    r = rng.choice([r for r in db["reservations"].values() if r["status"] == "active" and pred(r)])
    u = db["users"][r["user_id"]]
    card = next(k for k, m in u["payment_methods"].items() if m["type"] == "credit_card")
    facts = {"user_id": u["user_id"], "reservation_id": r["reservation_id"]}
    return r, u, card, facts, [act("get_user_details", user_id=u["user_id"]),
                               act("get_reservation_details", reservation_id=r["reservation_id"])]

def _rivals(u, card=None, reason=None):
    """Values a confirmation must not name beside the right ones: the user's other payment methods, and
    for a cancellation the other reason ("no longer needed; ordered by mistake" is not a yes)."""
    return ({"payment_method": [k for k in u["payment_methods"] if k != card]} if card else {}) | \
        ({"reason": [r for r in REASONS if r != reason]} if reason else {})

@scenario("retail", "cancel_order")
def _cancel_order(rng, db):
    o, u, facts, gold = _retail(rng, db, "pending")
    oid, reason = o["order_id"], rng.choice(list(REASONS))
    return dict(tier="easy", facts={**facts, "reason": reason}, confirm=[{"order_id": oid, "reason": reason}],
                rivals=_rivals(u, reason=reason),
                opening=f"Hi, I'm {u['name']}, email {u['email']}. Please cancel my order {oid}, {REASONS[reason]}.",
                gold=gold + [act("cancel_pending_order", order_id=oid, reason=reason)])

@scenario("retail", "change_order_payment")
def _change_order_payment(rng, db):
    o, u, facts, gold = _retail(rng, db, "pending")
    gift = next(k for k, m in u["payment_methods"].items() if m["type"] == "gift_card")
    return dict(tier="medium", facts={**facts, "payment_method": gift}, confirm=[{"order_id": o["order_id"], "payment_method": gift}],
                rivals=_rivals(u, gift),
                opening="Hello, I'd like to pay for one of my orders with my gift card instead.",
                gold=gold + [act("modify_pending_order_payment", order_id=o["order_id"], payment_method_id=gift)])

@scenario("retail", "return_item")
def _return_item(rng, db):
    o, u, facts, gold = _retail(rng, db, "delivered")
    item, paid_with = rng.choice(o["items"]), o["payment_history"][0]["payment_method_id"]
    return dict(tier="medium", facts={**facts, "item": item["name"], "payment_method": f"the original, {paid_with}"},
                rivals=_rivals(u, paid_with),
                opening=f"Hi, I want to return the {item['name']} I received.",
                confirm=[{"order_id": o["order_id"], "item": [item["item_id"], item["name"]],
                          "payment_method": paid_with}],
                gold=gold + [act("return_delivered_order_items", order_id=o["order_id"], item_ids=[item["item_id"]],
                                 payment_method_id=paid_with)])

def _exchanges_for(db, item):
    """Available variants of the item's product that differ from it in exactly one option."""
    return [v for v in db["products"][item["product_id"]]["variants"].values()
            if v["available"] and sum(v["options"][k] != x for k, x in item["options"].items()) == 1]

@scenario("retail", "exchange_item")
def _exchange_item(rng, db):
    o, u, facts, gold = _retail(rng, db, "delivered", lambda o: any(_exchanges_for(db, i) for i in o["items"]))
    item = rng.choice([i for i in o["items"] if _exchanges_for(db, i)])
    new, paid_with = rng.choice(_exchanges_for(db, item)), o["payment_history"][0]["payment_method_id"]
    axis, value = next((k, x) for k, x in new["options"].items() if item["options"][k] != x)
    return dict(tier="medium", facts={**facts, "item": item["name"], "option": f"{axis} {value}",
                                      "payment_method": paid_with}, rivals=_rivals(u, paid_with),
                opening=f"Hi, the {item['name']} I received is the wrong {axis}. Can I exchange it?",
                gold=gold + [act("get_product_details", product_id=item["product_id"]),
                             act("exchange_delivered_order_items", order_id=o["order_id"], item_ids=[item["item_id"]],
                                 new_item_ids=[new["item_id"]], payment_method_id=paid_with)],
                confirm=[{"order_id": o["order_id"], "option": [new["item_id"], f"{axis} {value}"],
                          "payment_method": paid_with}])

@scenario("retail", "order_status_total")
def _order_status_total(rng, db):
    status = rng.choice(["pending", "delivered", "processed"])
    o, u, facts, gold = _retail(rng, db, status, lambda o: str(o["payment_history"][0]["amount"])[-3] == ".")
    return dict(tier="medium", facts=facts, gold=gold, outputs=[status, f"{o['payment_history'][0]['amount']:.2f}"],
                opening="Hi, can you tell me the status and the total of one of my orders? No changes, just the info.")

@scenario("retail", "refuse_cancel_delivered")
def _refuse_cancel_delivered(rng, db):
    o, u, facts, gold = _retail(rng, db, "delivered")
    return dict(tier="hard", facts={**facts, "reason": "no longer needed"}, gold=gold, outputs=["delivered"],
                opening="I want to cancel an order, I don't need it anymore.")

@scenario("retail", "move_and_cancel")
def _move_and_cancel(rng, db):
    o, u, facts, gold = _retail(rng, db, "pending")
    new, reason = address(rng), rng.choice(list(REASONS))
    return dict(tier="hard", facts={**facts, "address": ", ".join(new.values()), "reason": reason},
                opening="Hi, I moved recently. Please update my address, and I also want to cancel an order.",
                gold=gold[:1] + [act("modify_user_address", user_id=u["user_id"], **new)] + gold[1:]
                + [act("cancel_pending_order", order_id=o["order_id"], reason=reason)],
                confirm=[{"address": new["address1"]}, {"order_id": o["order_id"], "reason": reason}],
                rivals=_rivals(u, reason=reason))

@scenario("airline", "add_bags")
def _add_bags(rng, db):
    r, u, card, facts, gold = _airline(rng, db)
    k, rid = rng.randint(1, 2), r["reservation_id"]
    return dict(tier="easy", facts={**facts, "bags": f"{k} more", "payment_method": card}, rivals=_rivals(u, card),
                confirm=[{"reservation_id": rid, "bags": str(r["total_baggages"] + k), "payment_method": card}],
                opening=f"Hi, I'm {u['name']}, user id {u['user_id']}. Please add {k} more checked bag{'s' * (k > 1)} "
                        f"to reservation {rid}, paid with my credit card {card}.",
                gold=gold + [act("update_reservation_baggages", reservation_id=rid,
                                 total_baggages=r["total_baggages"] + k, payment_method_id=card)])

@scenario("airline", "cancel_trip")
def _cancel_trip(rng, db):
    r, u, card, facts, gold = _airline(rng, db, lambda r: r["insurance"] or r["cabin"] == "business")
    return dict(tier="medium", facts={**facts, "reason": rng.choice(["change of plans", "I am sick"])},
                opening=f"Hi, I need to cancel my trip from {AIRPORTS[r['origin']]} on {r['date']}.",
                gold=gold + [act("cancel_reservation", reservation_id=r["reservation_id"])],
                confirm=[{"reservation_id": r["reservation_id"]}])

@scenario("airline", "change_flight_date")
def _change_flight_date(rng, db):
    def days(r):
        dates = db["flights"][r["flight_number"]]["dates"]
        return [d for d in DATES if d != r["date"] and dates[d]["seats"][r["cabin"]] >= len(r["passengers"])]
    r, u, card, facts, gold = _airline(rng, db, days)
    rid, fn, day = r["reservation_id"], r["flight_number"], rng.choice(days(r))
    return dict(tier="medium", facts={**facts, "flight": f"the same flight, {fn}", "payment_method": card},
                rivals=_rivals(u, card),
                opening=f"Hi, can I move my flight from {AIRPORTS[r['origin']]} to {AIRPORTS[r['destination']]} "
                        f"to {day}? Same flight, just another day.", confirm=[{"reservation_id": rid, "date": day, "payment_method": card}],
                gold=gold + [act("search_direct_flight", origin=r["origin"], destination=r["destination"], date=day),
                             act("update_reservation_flights", reservation_id=rid, flight_number=fn, date=day,
                                 payment_method_id=card)])

@scenario("airline", "book_flight")
def _book_flight(rng, db):
    _, u, card, _, gold = _airline(rng, db)           # a random user; their reservation plays no part
    f, day, cabin = rng.choice(list(db["flights"].values())), rng.choice(DATES), rng.choice(CABINS)
    insurance, bags, (first, last) = rng.random() < 0.5, rng.randint(0, 2), u["name"].split()
    o, d = f["origin"], f["destination"]
    return dict(tier="medium", facts={"user_id": u["user_id"], "flight": f"the {f['depart']} departure",
                                      "insurance": "yes" if insurance else "no", "bags": f"{bags} checked bags",
                                      "payment_method": card, "passenger": f"just me, born {u['dob']}"},
                rivals=_rivals(u, card),
                opening=f"Hi, I want to book a one-way {cabin} flight from {AIRPORTS[o]} ({o}) to {AIRPORTS[d]} ({d}) "
                        f"on {day}, just for me.", confirm=[{"flight": f["flight_number"], "date": day, "bags": str(bags), "payment_method": card}],
                gold=gold[:1] + [act("search_direct_flight", origin=o, destination=d, date=day),
                                 act("book_reservation", user_id=u["user_id"], flight_number=f["flight_number"],
                                     date=day, cabin=cabin, payment_method_id=card, insurance=insurance,
                                     total_baggages=bags,
                                     passengers=[dict(first_name=first, last_name=last, dob=u["dob"])])])

@scenario("airline", "refuse_cancel_uninsured")
def _refuse_cancel_uninsured(rng, db):
    r, u, card, facts, gold = _airline(rng, db, lambda r: not r["insurance"] and r["cabin"] == "economy")
    return dict(tier="hard", facts={**facts, "reason": "change of plans"}, gold=gold, outputs=["insurance"],
                opening="I want to cancel my reservation and get my money back.")

def _brief(domain, name, s, rng):
    """The user simulator's instruction: persona, request, known facts, when to confirm, how to end."""
    facts = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in s["facts"].items())
    confirm = ("When the agent asks you to confirm a change, say yes only if it matches your request and facts; "
               "otherwise correct it." if s.get("confirm") else "Do not agree to any change.")
    mood = rng.choice(["polite and brief", "friendly but a bit impatient", "chatty but cooperative"])
    return (f"You are {name}, {'a shop' if domain == 'retail' else 'an airline'} customer; you are {mood}. "
            f"Your request, as you first write it: \"{s['opening']}\" Facts you know: {facts}. Give a fact only "
            f"when the agent asks for it; never show this brief or ask for anything else. {confirm} When your "
            "request is done, or the agent has explained why it cannot be done, reply with ###STOP###.")

def generate_tasks(domain, split, n, seed=0):
    """n tasks, scenarios round-robin; task i depends only on (domain, split, seed, i)."""
    db, names, tasks = load_db(domain, split, seed), list(SCENARIOS[domain]), []   # builders only read the DB
    for i in range(n):
        rng, name = random.Random(f"{domain}-{split}-{seed}-{i}"), names[i % len(names)]
        s = SCENARIOS[domain][name](rng, db)
        who = s["facts"].get("name") or db["users"][s["facts"]["user_id"]]["name"]
        tasks.append(Task(f"{domain}-{split}-{i:05d}", domain, split, name, s["tier"], _brief(domain, who, s, rng),
                          s["opening"], s["facts"], s["gold"], s.get("outputs", []), s.get("confirm", []), seed,
                          s.get("rivals", {})))
    return tasks


def make_tasks(domain, split, n, tiers=None, seed=0):
    """envs.make_tasks for our domains. tiers None: the first n tasks. Otherwise (tier names, or scenario names:
    a scenario is a tier of its own) a training pool is the tasks among the first n whose tier or scenario is in
    tiers (rl.py samples from it), and a test set is the first n such tasks (eval.py's held-out set; rl.py's curve
    uses a later slice of it)."""
    if tiers is None:
        return generate_tasks(domain, split, n, seed)
    chosen = lambda t: t.tier in tiers or t.scenario in tiers      # noqa: E731
    if split == "train":
        return [t for t in generate_tasks(domain, split, n, seed) if chosen(t)]
    return [t for t in generate_tasks(domain, split, n * len(SCENARIOS[domain]), seed) if chosen(t)][:n]


def make_env(task, shaped=False):
    """A fresh environment for one rollout (envs.make_env for our domains)."""
    return Env(task, shaped)


# ----------------------------------------------------------------------------- the environment, one per rollout
def db_hash(db):
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()

def _diff(want, got, path, out):
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got), key=str):
            _diff(want.get(k, "<absent>"), got.get(k, "<absent>"), f"{path}.{k}" if path else k, out)
    elif isinstance(want, list) and isinstance(got, list):
        for i in range(max(len(want), len(got))):
            _diff(want[i] if i < len(want) else "<absent>", got[i] if i < len(got) else "<absent>", f"{path}[{i}]", out)
    elif want != got or type(want) is not type(got):
        out.append(f"{path}: {_short(got, 70)} (gold: {_short(want, 70)})")


class Score(NamedTuple):
    """What an episode earned, computed once from its final state and what the user could read (Env.score): every
    world's env returns one, and nothing is left on the env for a second call."""
    reward: float          # the training signal: 1.0 or 0.0 (shaped: partial credit for a failure)
    correct_state: bool    # the end state (and the outputs) right, however the episode ended: τ²'s cut-short rule
    wrong: str             # what was wrong, a line each; "" if nothing (the viewer's and eval's diff)
    extras: dict = {}      # a benchmark's other scores of the episode (ACEBench's process score)


def cut_short(stop_reason) -> str:
    """Why an episode scores 0 however its database looks, as τ² rules: it did not end itself (stop_reason
    max_turns, context_limit or error); "" if it did (in ENDED, or None: scored outside a rollout)."""
    return "" if stop_reason in (None, *ENDED) else f"ended by {stop_reason}: τ² scores a conversation cut short 0"


class Env:
    def __init__(self, task, shaped=False):
        self.task, self.shaped = task, shaped
        self.db = load_db(task.domain, task.split, task.seed)
        self.policy, self.tools = POLICIES[task.domain], tool_schemas(task.domain)
        self.writes, self._gold_db = [], None

    def step(self, name, arguments):
        """Run one tool call; return its observation. Never raises; a refused call changes nothing."""
        tools = TOOLS[self.task.domain]
        if not isinstance(name, str) or name not in tools:
            return f"Error: unknown tool {_short(name)}; tools: {', '.join(tools)}"
        fn, schema = tools[name]
        write, snapshot = name in WRITE_TOOLS[self.task.domain], None
        try:
            _check(arguments, schema["function"]["parameters"])
            arguments = json.loads(json.dumps(arguments))       # our own copy: nothing the caller holds enters the DB
            snapshot = json.dumps(self.db) if write else None   # tools validate before writing; this is the backstop
            out = fn(self.db, **arguments)
        except Exception as e:                        # a ToolError, or a bug: undo either way, never raise
            if snapshot is not None:
                self.db = json.loads(snapshot)
            return f"Error: {e}" if isinstance(e, ToolError) else f"Error: {name} failed ({type(e).__name__})"
        if write:
            self.writes.append(Action(name, arguments))
        return out if isinstance(out, str) else json.dumps(out, separators=(",", ":"))   # compact: fewer tokens

    def gold_db(self):
        """The DB after replaying the gold actions on a fresh copy (computed once per Env)."""
        if self._gold_db is None:
            gold = Env(self.task)
            for a in self.task.gold_actions:
                gold.step(a.name, a.arguments)
            self._gold_db = gold.db
        return self._gold_db

    def score(self, assistant_texts, stop_reason=None) -> Score:
        """Reward 1.0 iff DB hash == gold hash, every required output was said (case-insensitive substring), and
        the conversation ended (stop_reason None or in ENDED): as in τ², an episode cut off at the turn cap or the
        context limit scores 0, so an agent that makes the write but never reports it done, re-asking until the
        cap, does not pass. shaped=True: a failure still earns the fraction of gold write calls made exactly (as
        τ²'s wrapper does; so a cut-off episode that made every gold write earns 1.0). wrong: how it was cut short,
        the fields where the DB differs from the gold DB, the outputs missing."""
        said = "\n".join(t for t in (assistant_texts or []) if isinstance(t, str)).lower()
        missing = [o for o in self.task.required_outputs if o.lower() not in said]
        why = cut_short(stop_reason)
        fields = []
        _diff(self.gold_db(), self.db, "", fields)
        if len(fields) > 12:
            fields = fields[:12] + [f"... and {len(fields) - 12} more fields"]
        wrong = ([why] if why else []) + fields + [f"missing required output: {o!r}" for o in missing]
        correct = not missing and db_hash(self.db) == db_hash(self.gold_db())
        passed = correct and not why
        return Score(float(passed) if passed or not self.shaped else self._partial(), correct, "\n".join(wrong))

    def _partial(self) -> float:
        """The fraction of gold write calls made exactly (shaped reward)."""
        def key(a):
            return a.name, json.dumps(a.arguments, sort_keys=True)
        gold = [key(a) for a in self.task.gold_actions if a.name in WRITE_TOOLS[self.task.domain]]
        done = [key(a) for a in self.writes]
        return sum(min(gold.count(k), done.count(k)) for k in set(gold)) / len(gold) if gold else 0.0


# ----------------------------------------------------------------------------- tour: python -m envs.ours
def main():
    for domain in DOMAINS:
        tasks = generate_tasks(domain, "train", 2000)
        print(f"\n{'=' * 30} {domain}: {len(SCENARIOS[domain])} scenarios; 2000 train tasks made\n\n-- a sample task")
        print("\n".join(f"{k}: {v}" for k, v in vars(tasks[1]).items() if k != "gold_actions"), "\n\n-- tools")
        for f in (s["function"] for s in tool_schemas(domain)):
            writes = " [writes]" * (f["name"] in WRITE_TOOLS[domain])
            print(f"  {f['name']}({', '.join(f['parameters']['properties'])}){writes}: {f['description']}")
        print(f"\n-- policy ({len(POLICIES[domain].split())} words)\n{POLICIES[domain]}\n\n-- oracle replays")
        for i, t in enumerate(tasks[:len(SCENARIOS[domain])]):
            env = Env(t)
            for a in t.gold_actions:
                obs = env.step(a.name, a.arguments)
                if i < 2:                             # the first two episodes in full, then one line per scenario
                    print(f"  {a.name}({json.dumps(a.arguments)[:80]})\n    -> {obs[:100]}...")
            print(f"  {t.id} {t.scenario:24s} {t.tier:6s} oracle: reward {env.score(t.required_outputs).reward}; "
                  f"doing nothing: {Env(t).score([]).reward}")
        size = len(POLICIES[domain]) + len(json.dumps(tool_schemas(domain)))
        print(f"\npolicy + tool schemas: {size} characters (`python -m sampler.bench` runs a few episodes)")


if __name__ == "__main__":
    main()
