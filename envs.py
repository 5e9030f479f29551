"""Retail and airline tool-use environments with verifiable rewards (tau-bench style).

What: two procedurally generated domains (a database, tools over it with OpenAI JSON
schemas, a short written policy) and tasks from 14 scenarios in three difficulty tiers.
A task is a brief for a simulated user (persona, goal, facts revealed only when asked)
plus the gold actions an oracle agent would take. `Env(task)` gives each rollout a fresh
copy of the database; `reward()` is 1.0 iff the final database equals the database after
replaying the gold actions AND every required output was said by the agent.

Run:   python envs.py            # a tour: a task, the tools, the policy, oracle replays,
                                 # and the token count of the rendered system prompt
Test:  pytest tests/test_envs.py

Simplifications versus tau-bench: small catalogues and compact records so the system
prompt and observations fit a 135M model's context; every reservation is a single direct
one-way flight; no flight statuses; all tool parameters are required; "today" is fixed.
"""
import ast
import hashlib
import itertools
import json
import operator
import random
from dataclasses import dataclass
from functools import lru_cache

DOMAINS = ("retail", "airline")
TODAY = "2024-05-15"
SPLIT_USERS = {"train": 150, "test": 40}      # users per split DB; tasks resample them freely

# fact key -> lowercase words an agent would use to ask for it (the scripted user matches these)
FACT_KEYWORDS = {
    "email": ("email",),
    "name": ("name",),
    "zip": ("zip", "postal"),
    "user_id": ("user id", "user_id", "account id", "member id", "customer id"),
    "order_id": ("order id", "order number", "which order", "order_id"),
    "reservation_id": ("reservation id", "reservation number", "confirmation", "which reservation",
                       "reservation_id", "booking"),
    "address": ("address",),
    "payment_method": ("payment", "pay", "card", "refund to", "charge"),
    "item": ("which item", "which product", "item"),
    "option": ("size", "color", "option", "variant", "which one"),
    "reason": ("reason", "why"),
    "flight": ("which flight", "flight number", "time", "prefer"),
    "insurance": ("insurance",),
    "bags": ("bag", "luggage"),
    "passenger": ("passenger", "spelling", "correct name"),
}


@dataclass
class Action:
    name: str
    arguments: dict


@dataclass
class Task:
    id: str
    domain: str
    split: str
    scenario: str
    tier: str
    instruction: str
    opening: str
    hidden_facts: dict
    gold_actions: list
    required_outputs: list
    confirm_terms: list
    seed: int = 0                 # the DB seed (load_db(domain, split, seed))


class ToolError(Exception):
    """A refused tool call; Env.step turns it into an "Error: ..." observation."""


# ---------------------------------------------------------------------------------------------
# Tool registry: a tool is a Python function over the DB plus its JSON schema.
# ---------------------------------------------------------------------------------------------
S, I, B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
STRS = {"type": "array", "items": S}
PASSENGERS = {"type": "array", "items": {"type": "object", "properties": {
    "first_name": S, "last_name": S, "dob": S}, "required": ["first_name", "last_name", "dob"]}}
ADDRESS = {"address1": S, "city": S, "state": S, "zip": S}
TOOLS = {d: {} for d in DOMAINS}               # domain -> name -> (fn, schema)
WRITE_TOOLS = {d: set() for d in DOMAINS}


def tool(domains, description, write=False, **params):
    """Register fn under each domain; params are name=JSON schema, all required."""
    def register(fn):
        schema = {"type": "function", "function": {
            "name": fn.__name__.split("__")[0], "description": description,
            "parameters": {"type": "object", "properties": params, "required": list(params)}}}
        for d in domains.split():
            TOOLS[d][schema["function"]["name"]] = (fn, schema)
            if write:
                WRITE_TOOLS[d].add(schema["function"]["name"])
        return fn
    return register


def tool_schemas(domain):
    return [schema for _, schema in TOOLS[domain].values()]


def _short(x, n=40):
    s = repr(x)
    return s if len(s) <= n else s[:n] + "...'"


def _check(value, schema, path):
    """Validate value against our small JSON-schema subset; raise ToolError naming the path."""
    t = schema["type"]
    ok = {"string": lambda v: isinstance(v, str) and 0 < len(v) <= 200,
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1000,
          "boolean": lambda v: isinstance(v, bool),
          "array": lambda v: isinstance(v, list) and len(v) <= 10,
          "object": lambda v: isinstance(v, dict)}[t](value)
    if not ok:
        raise ToolError(f"{path} must be a {'short non-empty ' if t in ('string', 'array') else ''}{t}"
                        f", got {_short(value)}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolError(f"{path} must be one of {schema['enum']}")
    if t == "array":
        for i, v in enumerate(value):
            _check(v, schema["items"], f"{path}[{i}]")
    if t == "object":
        extra = [k for k in value if k not in schema["properties"]]
        missing = [k for k in schema["required"] if k not in value]
        if extra or missing:
            raise ToolError(f"{path or 'arguments'}: " + "; ".join(
                ([f"unexpected {_short(extra)}"] if extra else []) + ([f"missing {missing}"] if missing else [])))
        for k, v in value.items():
            _check(v, schema["properties"][k], f"{path}.{k}" if path else k)


def _get(table, key, what):
    if key not in table:
        raise ToolError(f"{what} {_short(key)} not found")
    return table[key]


def _money(x):
    return round(x + 0.0, 2)


def _payment_method(db, user_id, pm_id, amount=0.0):
    """The user's payment method pm_id; gift cards and certificates must cover amount."""
    pm = _get(db["users"][user_id]["payment_methods"], pm_id, "payment method")
    if "balance" in pm and amount > pm["balance"]:
        raise ToolError(f"{pm_id} balance {pm['balance']} is less than {_money(amount)}")
    return pm


def _pay(db, user_id, record, pm_id, amount):
    """Charge (amount > 0) or refund (amount < 0) pm_id; balances move with it. Validate first."""
    amount = _money(amount)
    pm = _payment_method(db, user_id, pm_id, max(amount, 0.0))
    if amount:
        if "balance" in pm:
            pm["balance"] = _money(pm["balance"] - amount)
        record["payment_history"].append({"type": "payment" if amount > 0 else "refund",
                                          "amount": abs(amount), "payment_method_id": pm_id})


def _refund_all(db, record):
    net = {}                                            # payment method -> amount still held
    for p in record["payment_history"]:
        net[p["payment_method_id"]] = net.get(p["payment_method_id"], 0) + p["amount"] * (1 if p["type"] == "payment" else -1)
    for pm_id, amount in net.items():
        if _money(amount) > 0:
            _pay(db, record["user_id"], record, pm_id, -amount)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ToolError("only numbers, + - * / and parentheses are allowed")


@tool("retail airline", "Evaluate arithmetic, e.g. '2*(3.5+1)'.", expression=S)
def calculate(db, expression):
    try:
        return str(round(_arith(ast.parse(expression, mode="eval").body), 2))
    except (SyntaxError, ZeroDivisionError, OverflowError, ValueError, RecursionError, TypeError):
        raise ToolError(f"cannot evaluate {_short(expression)}")


@tool("retail airline", "Hand the conversation to a human agent.", summary=S)
def transfer_to_human_agents(db, summary):
    return "Transfer successful."


@tool("retail airline", "Get a user's profile, payment methods and orders or reservations.", user_id=S)
def get_user_details(db, user_id):
    return _get(db["users"], user_id, "user")


# ---------------------------------------------------------------------------------------------
# Retail tools
# ---------------------------------------------------------------------------------------------
@tool("retail", "Find a user id by email.", email=S)
def find_user_id_by_email(db, email):
    for u in db["users"].values():
        if u["email"] == email.strip().lower():
            return u["user_id"]
    raise ToolError("user not found")


@tool("retail", "Find a user id by first name, last name and zip.", first_name=S, last_name=S, zip=S)
def find_user_id_by_name_zip(db, first_name, last_name, zip):
    for u in db["users"].values():
        if (u["name"].lower(), u["address"]["zip"]) == (f"{first_name} {last_name}".lower(), zip.strip()):
            return u["user_id"]
    raise ToolError("user not found")


@tool("retail", "Get an order's status, items, address and payments.", order_id=S)
def get_order_details(db, order_id):
    return _get(db["orders"], order_id, "order")


@tool("retail", "Get a product's variants (item ids, options, price, availability).", product_id=S)
def get_product_details(db, product_id):
    return _get(db["products"], product_id, "product")


def _order(db, order_id, status):
    order = _get(db["orders"], order_id, "order")
    if order["status"] != status:
        raise ToolError(f"order {order_id} is {order['status']}, only {status} orders allowed")
    return order


def _swap_items(db, order, item_ids, new_item_ids):
    """Check an item swap (same product, available variant); return [(index, new variant)]."""
    if len(item_ids) != len(new_item_ids) or len(set(item_ids)) != len(item_ids) or not item_ids:
        raise ToolError("item_ids and new_item_ids must be equal-length lists of distinct ids")
    owned = [i["item_id"] for i in order["items"]]
    swaps = []
    for old, new in zip(item_ids, new_item_ids):
        if old not in owned:
            raise ToolError(f"item {_short(old)} is not in order {order['order_id']}")
        idx = owned.index(old)
        variant = db["products"][order["items"][idx]["product_id"]]["variants"].get(new)
        if variant is None or new == old or not variant["available"]:
            raise ToolError(f"{_short(new)} is not another available variant of {order['items'][idx]['name']}")
        swaps.append((idx, variant))
    return swaps


@tool("retail", "Cancel a pending order.", write=True,
      order_id=S, reason={"type": "string", "enum": ["no longer needed", "ordered by mistake"]})
def cancel_pending_order(db, order_id, reason):
    order = _order(db, order_id, "pending")
    _refund_all(db, order)
    order.update(status="cancelled", cancel_reason=reason)
    return order


@tool("retail", "Change a pending order's shipping address.", write=True, order_id=S, **ADDRESS)
def modify_pending_order_address(db, order_id, address1, city, state, zip):
    order = _order(db, order_id, "pending")
    order["address"] = dict(address1=address1, city=city, state=state, zip=zip)
    return order


@tool("retail", "Swap items of a pending order for other variants; price difference via payment_method_id.",
      write=True, order_id=S, item_ids=STRS, new_item_ids=STRS, payment_method_id=S)
def modify_pending_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    order = _order(db, order_id, "pending")
    swaps = _swap_items(db, order, item_ids, new_item_ids)
    delta = sum(v["price"] - order["items"][i]["price"] for i, v in swaps)
    _pay(db, order["user_id"], order, payment_method_id, delta)
    for i, v in swaps:
        order["items"][i].update(item_id=v["item_id"], options=v["options"], price=v["price"])
    return order


@tool("retail", "Pay a pending order with another payment method.", write=True,
      order_id=S, payment_method_id=S)
def modify_pending_order_payment(db, order_id, payment_method_id):
    order = _order(db, order_id, "pending")
    old = [p for p in order["payment_history"] if p["type"] == "payment"][-1]["payment_method_id"]
    if payment_method_id == old:
        raise ToolError("the new payment method must differ from the current one")
    total = _money(sum(i["price"] for i in order["items"]))
    _payment_method(db, order["user_id"], payment_method_id, total)
    _pay(db, order["user_id"], order, payment_method_id, total)
    _pay(db, order["user_id"], order, old, -total)
    return order


@tool("retail", "Return items of a delivered order; refund to the original payment method or a gift card.",
      write=True, order_id=S, item_ids=STRS, payment_method_id=S)
def return_delivered_order_items(db, order_id, item_ids, payment_method_id):
    order = _order(db, order_id, "delivered")
    owned = [i["item_id"] for i in order["items"]]
    if not item_ids or len(set(item_ids)) != len(item_ids) or any(i not in owned for i in item_ids):
        raise ToolError(f"item_ids must be distinct items of order {order_id}")
    pm = _payment_method(db, order["user_id"], payment_method_id)
    if payment_method_id != order["payment_history"][0]["payment_method_id"] and pm["type"] != "gift_card":
        raise ToolError("refunds go to the original payment method or a gift card")
    order.update(status="return requested", return_items=sorted(item_ids), return_payment_method_id=payment_method_id)
    return order


@tool("retail", "Exchange items of a delivered order for other variants; price difference via payment_method_id.",
      write=True, order_id=S, item_ids=STRS, new_item_ids=STRS, payment_method_id=S)
def exchange_delivered_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    order = _order(db, order_id, "delivered")
    swaps = _swap_items(db, order, item_ids, new_item_ids)
    delta = _money(sum(v["price"] - order["items"][i]["price"] for i, v in swaps))
    _payment_method(db, order["user_id"], payment_method_id, max(delta, 0.0))
    order.update(status="exchange requested", exchange_items=item_ids, exchange_new_items=new_item_ids,
                 exchange_payment_method_id=payment_method_id, exchange_price_difference=delta)
    return order


@tool("retail", "Change a user's default address.", write=True, user_id=S, **ADDRESS)
def modify_user_address(db, user_id, address1, city, state, zip):
    user = _get(db["users"], user_id, "user")
    user["address"] = dict(address1=address1, city=city, state=state, zip=zip)
    return user


# ---------------------------------------------------------------------------------------------
# Airline tools
# ---------------------------------------------------------------------------------------------
BAG_FEE, INSURANCE_FEE = 50, 30
CABIN = {"type": "string", "enum": ["economy", "business"]}


@tool("airline", "Get a reservation's flight, passengers, bags and payments.", reservation_id=S)
def get_reservation_details(db, reservation_id):
    return _get(db["reservations"], reservation_id, "reservation")


@tool("airline", "List direct flights on a date (YYYY-MM-DD) with prices and free seats.",
      origin=S, destination=S, date=S)
def search_direct_flight(db, origin, destination, date):
    return [dict(flight_number=f["flight_number"], depart=f["depart"], **f["dates"][date])
            for f in db["flights"].values()
            if (f["origin"], f["destination"]) == (origin, destination) and date in f["dates"]]


def _flight_day(db, flight_number, date, cabin, n):
    """The flight's entry for date, checked to be in the future with n free seats in cabin."""
    flight = _get(db["flights"], flight_number, "flight")
    day = _get(flight["dates"], date, f"date for {flight_number}")
    if date <= TODAY:
        raise ToolError(f"{date} is not in the future")
    if day["seats"][cabin] < n:
        raise ToolError(f"not enough {cabin} seats on {flight_number} {date}")
    return day


def _free_bags(db, res):
    return len(res["passengers"]) * ({"economy": 1, "business": 2}[res["cabin"]]
                                     + (db["users"][res["user_id"]]["membership"] == "gold"))


def _active(db, reservation_id):
    res = _get(db["reservations"], reservation_id, "reservation")
    if res["status"] != "active":
        raise ToolError(f"reservation {reservation_id} is {res['status']}")
    return res


@tool("airline", "Book a one-way direct flight for 1-5 passengers.", write=True, user_id=S, flight_number=S,
      date=S, cabin=CABIN, passengers=PASSENGERS, payment_method_id=S, insurance=B, total_baggages=I)
def book_reservation(db, user_id, flight_number, date, cabin, passengers, payment_method_id, insurance,
                     total_baggages):
    _get(db["users"], user_id, "user")
    if not 1 <= len(passengers) <= 5 or not 0 <= total_baggages <= 10:
        raise ToolError("need 1-5 passengers and 0-10 bags")
    day = _flight_day(db, flight_number, date, cabin, len(passengers))
    flight = db["flights"][flight_number]
    rid = f"NEW{len(db['reservations']):03d}"
    res = dict(reservation_id=rid, user_id=user_id, origin=flight["origin"], destination=flight["destination"],
               flight_number=flight_number, date=date, cabin=cabin, passengers=passengers, insurance=insurance,
               total_baggages=total_baggages, status="active", payment_history=[])
    extra = max(0, total_baggages - _free_bags(db, res))
    total = len(passengers) * (day["prices"][cabin] + INSURANCE_FEE * insurance) + BAG_FEE * extra
    _pay(db, user_id, res, payment_method_id, total)
    day["seats"][cabin] -= len(passengers)
    db["reservations"][rid] = res
    db["users"][user_id]["reservations"].append(rid)
    return res


@tool("airline", "Cancel a reservation (needs insurance or business cabin); refunds all payments.",
      write=True, reservation_id=S)
def cancel_reservation(db, reservation_id):
    res = _active(db, reservation_id)
    if not (res["insurance"] or res["cabin"] == "business"):
        raise ToolError("only reservations with travel insurance or in business cabin can be cancelled")
    _refund_all(db, res)
    db["flights"][res["flight_number"]]["dates"][res["date"]]["seats"][res["cabin"]] += len(res["passengers"])
    res["status"] = "cancelled"
    return res


@tool("airline", "Set a reservation's total checked bags (can only grow); extra bags paid via payment_method_id.",
      write=True, reservation_id=S, total_baggages=I, payment_method_id=S)
def update_reservation_baggages(db, reservation_id, total_baggages, payment_method_id):
    res = _active(db, reservation_id)
    if not res["total_baggages"] < total_baggages <= 10:
        raise ToolError(f"total_baggages must be more than the current {res['total_baggages']} and at most 10")
    free = _free_bags(db, res)
    fee = BAG_FEE * (max(0, total_baggages - free) - max(0, res["total_baggages"] - free))
    _pay(db, res["user_id"], res, payment_method_id, fee)
    res["total_baggages"] = total_baggages
    return res


@tool("airline", "Move a reservation to another flight/date on the same route and cabin; fare difference via "
      "payment_method_id.", write=True, reservation_id=S, flight_number=S, date=S, payment_method_id=S)
def update_reservation_flights(db, reservation_id, flight_number, date, payment_method_id):
    res = _active(db, reservation_id)
    n, cabin = len(res["passengers"]), res["cabin"]
    new = _flight_day(db, flight_number, date, cabin, n)
    flight = db["flights"][flight_number]
    if (flight["origin"], flight["destination"]) != (res["origin"], res["destination"]) or \
            (flight_number, date) == (res["flight_number"], res["date"]):
        raise ToolError("the new flight must differ and have the same origin and destination")
    if res["date"] <= TODAY:
        raise ToolError("the flight already departed")
    old = db["flights"][res["flight_number"]]["dates"][res["date"]]
    _pay(db, res["user_id"], res, payment_method_id, n * (new["prices"][cabin] - old["prices"][cabin]))
    old["seats"][cabin] += n
    new["seats"][cabin] -= n
    res.update(flight_number=flight_number, date=date)
    return res


@tool("airline", "Correct passenger names/dates of birth (same number of passengers).", write=True,
      reservation_id=S, passengers=PASSENGERS)
def update_reservation_passengers(db, reservation_id, passengers):
    res = _active(db, reservation_id)
    if len(passengers) != len(res["passengers"]):
        raise ToolError(f"the reservation has {len(res['passengers'])} passengers")
    res["passengers"] = passengers
    return res


@tool("airline", "Give a user a travel certificate (amount 1-500).", write=True, user_id=S, amount=I)
def send_certificate(db, user_id, amount):
    user = _get(db["users"], user_id, "user")
    if not 1 <= amount <= 500:
        raise ToolError("amount must be 1-500")
    pm_id = f"certificate_{len(user['payment_methods']) + 1}"
    user["payment_methods"][pm_id] = dict(id=pm_id, type="certificate", balance=float(amount))
    return f"Certificate {pm_id} of {amount} added."


POLICIES = {
    "retail": f"""You are a customer service agent for an online shop. Today is {TODAY}.
- First authenticate the user: find their user id by email, or by first name, last name and zip. Then help only that user with their own orders.
- Look things up with tools; never guess ids, prices or options. Make at most one tool call per message.
- Before any change (cancel, modify, return, exchange, address update) state the order id, the items or new values and the payment method, and ask the user to confirm. Act only after an explicit yes.
- Only pending orders can be cancelled or modified (shipping address, payment method, items). Cancel reasons: "no longer needed" or "ordered by mistake". Cancellation refunds the original payment.
- Item changes and exchanges: an item can only become another available variant of the same product (see get_product_details). The price difference is charged or refunded via a payment method the user picks.
- A new payment method must differ from the current one; a gift card needs enough balance.
- Only delivered orders can be returned or exchanged. Refunds go to the original payment method or a gift card.
- Processed, delivered and cancelled orders cannot be cancelled or modified. If a request breaks a rule, refuse and say why, naming the order status.
- When asked about an order, give its status and total exactly as the tool shows them.
- Transfer to a human agent only if the request cannot be handled with your tools.""",
    "airline": f"""You are an airline customer service agent. Today is {TODAY}.
- First get the user id and look the user up. Help only that user with their own reservations.
- Look things up with tools; never guess ids, flights or prices. Make at most one tool call per message.
- Before any change (booking, cancellation, flight change, bags, passengers) state the reservation or flight, the new values and the payment method, and ask the user to confirm. Act only after an explicit yes.
- Booking: one-way direct flights, one cabin (economy or business) for all 1-5 passengers, paid with one payment method of the user. Travel insurance costs {INSURANCE_FEE} per passenger. Gift cards and certificates need enough balance.
- Checked bags: free per passenger 1 in economy, 2 in business, plus 1 for gold members. Each extra bag costs {BAG_FEE}. Bags can be added, never removed.
- Flight change: to another flight or date with the same origin, destination and cabin. The fare difference for all passengers is charged or refunded via a payment method of the user.
- Passenger names and dates of birth can be corrected; the number of passengers cannot change.
- Cancellation: only if the reservation has travel insurance or is in business cabin; all payments are refunded. Otherwise refuse and explain it has no insurance.
- Certificates only when a supervisor approves; transfer to a human agent for complaints.""",
}


# ---------------------------------------------------------------------------------------------
# Databases: one generation pass per (domain, seed) so train and test never share ids.
# ---------------------------------------------------------------------------------------------
FIRST = "Emma Liam Olivia Noah Ava Mason Sofia Lucas Mia Ethan Yara Omar Chen Priya Diego Lena Ivan Aisha Mateo Nora".split()
LAST = "Smith Garcia Kim Patel Nguyen Brown Lopez Rossi Cohen Silva Ito Novak Khan Moreau Berg Okafor Reyes Hale".split()
STREETS = "Oak St,Maple Ave,Pine Rd,Cedar Ln,Elm St,Lake Dr,Hill Rd,Park Ave".split(",")
CITIES = [("Austin", "TX"), ("Denver", "CO"), ("Seattle", "WA"), ("Boston", "MA"), ("Chicago", "IL"), ("Miami", "FL")]
PRODUCTS = {  # product id -> (name, option axis 1, option axis 2)
    "TEE": ("T-Shirt", ("color", "red blue black"), ("size", "S M")),
    "HAT": ("Sun Hat", ("color", "beige navy olive"), ("size", "S L")),
    "SHO": ("Running Shoes", ("color", "white grey red"), ("size", "9 10")),
    "LMP": ("Desk Lamp", ("color", "black white silver"), ("bulb", "LED halogen")),
    "BAG": ("Backpack", ("color", "green black blue"), ("size", "20L 30L")),
    "MUG": ("Travel Mug", ("color", "steel red white"), ("size", "12oz 16oz")),
}
AIRPORTS = {"JFK": "New York", "LAX": "Los Angeles", "SFO": "San Francisco", "ORD": "Chicago",
            "SEA": "Seattle", "MIA": "Miami"}
DATES = [f"2024-05-{d}" for d in range(16, 26)]


def _uid(rng, used, make):
    while True:
        x = make()
        if x not in used:
            used.add(x)
            return x


def _address(rng):
    city, state = rng.choice(CITIES)
    return dict(address1=f"{rng.randint(1, 999)} {rng.choice(STREETS)}", city=city, state=state,
                zip=f"{rng.randint(10000, 99999)}")


def _price(rng, lo, hi):
    cents = rng.randrange(lo * 100, hi * 100)
    return (cents + (cents % 10 == 0)) / 100           # never a trailing zero: "54.27" reads the same everywhere


def _user(rng, used, cards):
    first, last = rng.choice(FIRST), rng.choice(LAST)
    uid = _uid(rng, used, lambda: f"{first}_{last}_{rng.randint(1000, 9999)}".lower())
    pms = {}
    for kind in cards:
        pm_id = _uid(rng, used, lambda: f"{kind}_{rng.randint(1000, 9999)}")
        pms[pm_id] = dict(id=pm_id, type=kind, **({"balance": float(rng.randint(300, 600))} if kind != "credit_card"
                                                  and kind != "paypal" else {}))
    return dict(user_id=uid, name=f"{first} {last}", email=uid.replace("_", ".", 1).replace("_", "") + "@example.com",
                address=_address(rng), payment_methods=pms)


def _catalog(rng):
    products = {}
    for pid, (name, (a1, v1), (a2, v2)) in PRODUCTS.items():
        combos = list(itertools.product(v1.split(), v2.split()))
        sold_out = rng.randrange(len(combos))
        variants = {f"{pid}{k + 1:03d}": dict(item_id=f"{pid}{k + 1:03d}", options={a1: x, a2: y},
                                              price=_price(rng, 15, 90), available=k != sold_out)
                    for k, (x, y) in enumerate(combos)}
        products[pid] = dict(product_id=pid, name=name, variants=variants)
    return products


def _retail_split(rng, used, products, n_users):
    db = dict(users={}, orders={}, products=products)
    for _ in range(n_users):
        u = _user(rng, used, ["credit_card", "gift_card", "paypal"])
        u["orders"] = []
        statuses = ["pending", "pending", "delivered", "delivered", rng.choice(["processed", "cancelled"])]
        for status in rng.sample(statuses, len(statuses)):
            oid = _uid(rng, used, lambda: f"#W{rng.randint(1000000, 9999999)}")
            items = [dict(item_id=v["item_id"], product_id=p["product_id"], name=p["name"], options=v["options"],
                          price=v["price"])
                     for p in rng.sample(list(products.values()), rng.randint(1, 3))
                     for v in [rng.choice(list(p["variants"].values()))]]
            pm = rng.choice([k for k, m in u["payment_methods"].items() if m["type"] != "gift_card"])
            total = _money(sum(i["price"] for i in items))
            db["orders"][oid] = dict(order_id=oid, user_id=u["user_id"], status=status, address=u["address"],
                                     items=items, payment_history=[dict(type="payment", amount=total,
                                                                        payment_method_id=pm)])
            u["orders"].append(oid)
        db["users"][u["user_id"]] = u
    return db


def _flights(rng):
    flights = {}
    routes = [("JFK", "LAX"), ("JFK", "SFO"), ("ORD", "SEA"), ("LAX", "SEA"), ("MIA", "JFK"), ("SFO", "ORD")]
    for a, b in routes + [(b, a) for a, b in routes]:
        for depart in rng.sample(["07:00", "10:30", "14:00", "18:45"], 2):
            fn = _uid(rng, set(flights), lambda: f"HAT{rng.randint(100, 999)}")
            base = rng.randint(90, 300)
            flights[fn] = dict(flight_number=fn, origin=a, destination=b, depart=depart, dates={
                d: dict(prices=dict(economy=base + rng.randint(0, 60), business=3 * base + rng.randint(0, 150)),
                        seats=dict(economy=rng.randint(5, 40), business=rng.randint(2, 10))) for d in DATES})
    return flights


def _airline_split(rng, used, flights, n_users):
    db = dict(users={}, reservations={}, flights=flights, airports=AIRPORTS)
    for _ in range(n_users):
        u = _user(rng, used, ["credit_card", "gift_card", "certificate"][:rng.randint(2, 3)])
        u.update(dob=f"19{rng.randint(55, 99)}-0{rng.randint(1, 9)}-{rng.randint(10, 28)}",
                 membership=rng.choice(["regular", "silver", "gold"]), reservations=[])
        for insured, cabin in [(True, "economy"), (False, "economy"), (rng.random() < 0.5, rng.choice(["economy", "business"]))]:
            rid = _uid(rng, used, lambda: "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ23456789", k=6)))
            f = rng.choice(list(flights.values()))
            first, last = u["name"].split()
            pax = [dict(first_name=first, last_name=last, dob=u["dob"])] + [
                dict(first_name=rng.choice(FIRST), last_name=last, dob=f"19{rng.randint(55, 99)}-11-0{rng.randint(1, 9)}")
                for _ in range(rng.choice([0, 0, 1]))]
            date = rng.choice(DATES[:-1])
            total = len(pax) * (f["dates"][date]["prices"][cabin] + INSURANCE_FEE * insured)
            db["reservations"][rid] = dict(
                reservation_id=rid, user_id=u["user_id"], origin=f["origin"], destination=f["destination"],
                flight_number=f["flight_number"], date=date, cabin=cabin, passengers=pax, insurance=insured,
                total_baggages=rng.randint(0, 1), status="active", payment_history=[dict(
                    type="payment", amount=float(total), payment_method_id=next(iter(u["payment_methods"])))])
            u["reservations"].append(rid)
        db["users"][u["user_id"]] = u
    return db


@lru_cache(maxsize=8)
def _db_json(domain, split, seed):
    """Both splits come from one generator so their ids are disjoint; cached as JSON text."""
    rng, used = random.Random(f"{domain}-db-{seed}"), set()
    shared = _catalog(rng) if domain == "retail" else _flights(rng)
    make = _retail_split if domain == "retail" else _airline_split
    dbs = {s: make(rng, used, shared, n) for s, n in SPLIT_USERS.items()}
    return json.dumps(dbs[split])


def load_db(domain, split, seed=0):
    """A fresh copy of the database the split's tasks live in (JSON round trip: no shared objects)."""
    return json.loads(_db_json(domain, split, seed))


# ---------------------------------------------------------------------------------------------
# Scenarios: each picks rows from the split's DB and returns the task's parts.
# ---------------------------------------------------------------------------------------------
SCENARIOS = {d: {} for d in DOMAINS}          # domain -> scenario name -> builder(rng, db) -> dict
REASONS = {"no longer needed": "I no longer need it", "ordered by mistake": "I ordered it by mistake"}


def scenario(domain, name):
    def register(fn):
        SCENARIOS[domain][name] = fn
        return fn
    return register


def _pick(rng, table, pred):
    rows = list(table.values())
    for _ in range(10000):
        row = rng.choice(rows)
        if pred(row):
            return row
    raise RuntimeError("no database row fits the scenario")


def _shopper(db, order):
    """The order's user, the facts that authenticate them, and the oracle's lookup."""
    u = db["users"][order["user_id"]]
    facts = {"email": u["email"], "name": u["name"], "zip": u["address"]["zip"]}
    return u, facts, Action("find_user_id_by_email", {"email": u["email"]})


def _traveller(db, uid):
    u = db["users"][uid]
    return u, {"user_id": uid}, Action("get_user_details", {"user_id": uid})


def _addr_text(a):
    return f"{a['address1']}, {a['city']}, {a['state']} {a['zip']}"


def _order_total(o):
    return _money(sum(i["price"] for i in o["items"]))


def _paid_with(o):
    return o["payment_history"][0]["payment_method_id"]


@scenario("retail", "cancel_order")
def _cancel_order(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "pending")
    u, facts, find = _shopper(db, o)
    reason, oid = rng.choice(list(REASONS)), o["order_id"]
    return dict(tier="easy", goal=f"cancel order {oid} ({reason}).", facts={**facts, "order_id": oid, "reason": reason},
                opening=f"Hi, I'm {u['name']}, email {u['email']}. Please cancel my order {oid}, {REASONS[reason]}.",
                gold=[find, Action("get_order_details", {"order_id": oid}),
                      Action("cancel_pending_order", {"order_id": oid, "reason": reason})], confirm=[[oid]])


@scenario("retail", "modify_order_address")
def _modify_order_address(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "pending")
    u, facts, find = _shopper(db, o)
    new, oid = _address(rng), o["order_id"]
    return dict(tier="medium", goal=f"ship one of your pending orders to {_addr_text(new)} instead.",
                facts={**facts, "order_id": oid, "address": _addr_text(new)},
                opening="Hi, I need to change the shipping address of one of my orders.",
                gold=[find, Action("get_order_details", {"order_id": oid}),
                      Action("modify_pending_order_address", {"order_id": oid, **new})],
                confirm=[[oid, new["address1"]]])


@scenario("retail", "change_order_payment")
def _change_order_payment(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "pending")
    u, facts, find = _shopper(db, o)
    gift, oid = next(k for k, m in u["payment_methods"].items() if m["type"] == "gift_card"), o["order_id"]
    return dict(tier="medium", goal=f"pay order {oid} with your gift card instead.",
                facts={**facts, "order_id": oid, "payment_method": gift},
                opening="Hello, I'd like to pay for one of my orders with my gift card instead.",
                gold=[find, Action("get_user_details", {"user_id": u["user_id"]}),
                      Action("get_order_details", {"order_id": oid}),
                      Action("modify_pending_order_payment", {"order_id": oid, "payment_method_id": gift})],
                confirm=[[oid, gift]])


@scenario("retail", "return_item")
def _return_item(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "delivered")
    u, facts, find = _shopper(db, o)
    item, oid = rng.choice(o["items"]), o["order_id"]
    return dict(tier="medium", goal=f"return the {item['name']} from order {oid}, refunded to the original payment.",
                facts={**facts, "order_id": oid, "item": item["name"], "payment_method": _paid_with(o)},
                opening=f"Hi, I want to return the {item['name']} I received.",
                gold=[find, Action("get_order_details", {"order_id": oid}),
                      Action("return_delivered_order_items", {"order_id": oid, "item_ids": [item["item_id"]],
                                                              "payment_method_id": _paid_with(o)})],
                confirm=[[oid, item["item_id"]]])


def _swaps(db, item):
    """Available variants of item's product that differ from it in exactly one option."""
    return [v for v in db["products"][item["product_id"]]["variants"].values()
            if v["available"] and sum(v["options"][k] != x for k, x in item["options"].items()) == 1]


@scenario("retail", "exchange_item")
def _exchange_item(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "delivered" and any(_swaps(db, i) for i in o["items"]))
    u, facts, find = _shopper(db, o)
    item = rng.choice([i for i in o["items"] if _swaps(db, i)])
    new, oid = rng.choice(_swaps(db, item)), o["order_id"]
    axis, value = next((k, x) for k, x in new["options"].items() if item["options"][k] != x)
    return dict(tier="medium", goal=f"exchange the {item['name']} from order {oid} for {axis} {value}.",
                facts={**facts, "order_id": oid, "item": item["name"], "option": f"{axis} {value}",
                       "payment_method": _paid_with(o)},
                opening=f"Hi, the {item['name']} I received is the wrong {axis}. Can I exchange it?",
                gold=[find, Action("get_order_details", {"order_id": oid}),
                      Action("get_product_details", {"product_id": item["product_id"]}),
                      Action("exchange_delivered_order_items", {
                          "order_id": oid, "item_ids": [item["item_id"]], "new_item_ids": [new["item_id"]],
                          "payment_method_id": _paid_with(o)})],
                confirm=[[oid, new["item_id"]]])


@scenario("retail", "order_status_total")
def _order_status_total(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] != "cancelled" and f"{_order_total(o):.2f}"[-1] != "0")
    u, facts, find = _shopper(db, o)
    return dict(tier="medium", goal=f"learn the status and the total of order {o['order_id']}. You want no changes.",
                facts={**facts, "order_id": o["order_id"]},
                opening="Hi, can you tell me the status and the total of one of my orders?",
                gold=[find, Action("get_order_details", {"order_id": o["order_id"]})],
                outputs=[o["status"], f"{_order_total(o):.2f}"])


@scenario("retail", "refuse_cancel_delivered")
def _refuse_cancel_delivered(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "delivered")
    u, facts, find = _shopper(db, o)
    return dict(tier="hard", goal=f"cancel order {o['order_id']}. If the agent says it cannot be cancelled, accept "
                                  "that; do not ask for a return.",
                facts={**facts, "order_id": o["order_id"], "reason": "no longer needed"},
                opening="I want to cancel an order, I don't need it anymore.",
                gold=[find, Action("get_order_details", {"order_id": o["order_id"]})], outputs=["delivered"])


@scenario("retail", "move_and_cancel")
def _move_and_cancel(rng, db):
    o = _pick(rng, db["orders"], lambda o: o["status"] == "pending")
    u, facts, find = _shopper(db, o)
    new, oid, reason = _address(rng), o["order_id"], rng.choice(list(REASONS))
    return dict(tier="hard", goal=f"update your default address to {_addr_text(new)}, and cancel order {oid} "
                                  f"({reason}).",
                facts={**facts, "address": _addr_text(new), "order_id": oid, "reason": reason},
                opening="Hi, I moved recently. I need to update my address, and I want to cancel an order.",
                gold=[find, Action("get_user_details", {"user_id": u["user_id"]}),
                      Action("modify_user_address", {"user_id": u["user_id"], **new}),
                      Action("get_order_details", {"order_id": oid}),
                      Action("cancel_pending_order", {"order_id": oid, "reason": reason})],
                confirm=[[new["address1"]], [oid]])


def _card(u):
    return next(k for k, m in u["payment_methods"].items() if m["type"] == "credit_card")


@scenario("airline", "add_bags")
def _add_bags(rng, db):
    r = _pick(rng, db["reservations"], lambda r: r["status"] == "active")
    u, facts, lookup = _traveller(db, r["user_id"])
    k, rid = rng.randint(1, 2), r["reservation_id"]
    total = r["total_baggages"] + k
    return dict(tier="easy", goal=f"add {k} checked bag(s) to reservation {rid} (total {total}), paid by credit card.",
                facts={**facts, "reservation_id": rid, "bags": f"{k} more, {total} in total", "payment_method": _card(u)},
                opening=f"Hi, I'm {u['name']}, user id {r['user_id']}. Please add {k} checked bag{'s' * (k > 1)} "
                        f"to reservation {rid}, paid with my credit card.",
                gold=[lookup, Action("get_reservation_details", {"reservation_id": rid}),
                      Action("update_reservation_baggages", {"reservation_id": rid, "total_baggages": total,
                                                             "payment_method_id": _card(u)})],
                confirm=[[rid]])


@scenario("airline", "cancel_trip")
def _cancel_trip(rng, db):
    r = _pick(rng, db["reservations"], lambda r: r["status"] == "active" and (r["insurance"] or r["cabin"] == "business"))
    u, facts, lookup = _traveller(db, r["user_id"])
    rid = r["reservation_id"]
    return dict(tier="medium", goal=f"cancel reservation {rid} ({r['origin']} to {r['destination']} on {r['date']}).",
                facts={**facts, "reservation_id": rid, "reason": rng.choice(["change of plans", "I am sick"])},
                opening="Hi, I need to cancel one of my trips.",
                gold=[lookup, Action("get_reservation_details", {"reservation_id": rid}),
                      Action("cancel_reservation", {"reservation_id": rid})], confirm=[[rid]])


@scenario("airline", "change_flight_date")
def _change_flight_date(rng, db):
    def fits(r, d):
        return d != r["date"] and db["flights"][r["flight_number"]]["dates"][d]["seats"][r["cabin"]] >= len(r["passengers"])
    r = _pick(rng, db["reservations"], lambda r: r["status"] == "active" and any(fits(r, d) for d in DATES))
    u, facts, lookup = _traveller(db, r["user_id"])
    rid, fn, day = r["reservation_id"], r["flight_number"], rng.choice([d for d in DATES if fits(r, d)])
    return dict(tier="medium", goal=f"move reservation {rid} to the same flight {fn} on {day}; pay any difference "
                                    "by credit card.",
                facts={**facts, "reservation_id": rid, "flight": f"the same flight, {fn}", "payment_method": _card(u)},
                opening=f"Hi, can I move my flight from {AIRPORTS[r['origin']]} to {AIRPORTS[r['destination']]} "
                        f"to {day}? Same flight, just another day.",
                gold=[lookup, Action("get_reservation_details", {"reservation_id": rid}),
                      Action("search_direct_flight", {"origin": r["origin"], "destination": r["destination"], "date": day}),
                      Action("update_reservation_flights", {"reservation_id": rid, "flight_number": fn, "date": day,
                                                            "payment_method_id": _card(u)})],
                confirm=[[rid, day]])


@scenario("airline", "book_flight")
def _book_flight(rng, db):
    u = _pick(rng, db["users"], lambda u: True)
    f, day = rng.choice(list(db["flights"].values())), rng.choice(DATES)
    cabin, insurance, bags = rng.choice(["economy", "business"]), rng.random() < 0.5, rng.randint(0, 2)
    _, facts, lookup = _traveller(db, u["user_id"])
    first, last = u["name"].split()
    o, d = f["origin"], f["destination"]
    return dict(tier="medium", goal=f"book a one-way {cabin} flight {o}->{d} on {day} for yourself only: the "
                                    f"{f['depart']} departure ({f['flight_number']}), {bags} checked bags, "
                                    f"{'with' if insurance else 'no'} insurance, paid by credit card.",
                facts={**facts, "flight": f"the {f['depart']} departure", "insurance": "yes" if insurance else "no",
                       "bags": str(bags), "payment_method": _card(u), "passenger": f"just me, born {u['dob']}"},
                opening=f"Hi, I want to book a one-way {cabin} flight from {AIRPORTS[o]} ({o}) to {AIRPORTS[d]} ({d}) "
                        f"on {day}, just for me.",
                gold=[lookup, Action("search_direct_flight", {"origin": o, "destination": d, "date": day}),
                      Action("book_reservation", {
                          "user_id": u["user_id"], "flight_number": f["flight_number"], "date": day, "cabin": cabin,
                          "passengers": [{"first_name": first, "last_name": last, "dob": u["dob"]}],
                          "payment_method_id": _card(u), "insurance": insurance, "total_baggages": bags})],
                confirm=[[f["flight_number"]]])


@scenario("airline", "refuse_cancel_uninsured")
def _refuse_cancel_uninsured(rng, db):
    r = _pick(rng, db["reservations"], lambda r: r["status"] == "active" and not r["insurance"] and r["cabin"] == "economy")
    u, facts, lookup = _traveller(db, r["user_id"])
    return dict(tier="hard", goal=f"cancel reservation {r['reservation_id']} for a full refund. If the agent says it "
                                  "cannot be cancelled, accept that.",
                facts={**facts, "reservation_id": r["reservation_id"], "reason": "change of plans"},
                opening="I want to cancel my reservation and get my money back.",
                gold=[lookup, Action("get_reservation_details", {"reservation_id": r["reservation_id"]})],
                outputs=["insurance"])


@scenario("airline", "fix_name_add_bag")
def _fix_name_add_bag(rng, db):
    r = _pick(rng, db["reservations"], lambda r: r["status"] == "active")
    u, facts, lookup = _traveller(db, r["user_id"])
    rid, p = r["reservation_id"], r["passengers"][0]
    fixed = p["last_name"][:-1] + ("e" if p["last_name"][-1] != "e" else "a")
    pax = [{**p, "last_name": fixed}] + r["passengers"][1:]
    return dict(tier="hard", goal=f"on reservation {rid}, correct passenger {p['first_name']} {p['last_name']} to "
                                  f"{p['first_name']} {fixed}, and add one checked bag paid by credit card.",
                facts={**facts, "reservation_id": rid, "passenger": f"{p['first_name']} {fixed} (booked as "
                       f"{p['first_name']} {p['last_name']})", "bags": "1 more", "payment_method": _card(u)},
                opening="Hi, a passenger's last name is misspelled on my booking, and I also want to add a checked bag.",
                gold=[lookup, Action("get_reservation_details", {"reservation_id": rid}),
                      Action("update_reservation_passengers", {"reservation_id": rid, "passengers": pax}),
                      Action("update_reservation_baggages", {"reservation_id": rid,
                                                             "total_baggages": r["total_baggages"] + 1,
                                                             "payment_method_id": _card(u)})],
                confirm=[[rid, fixed], [rid]])


def _brief(domain, name, s, rng):
    facts = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in s["facts"].items())
    confirm = ("When the agent asks you to confirm a change, say yes only if it matches your goal; otherwise correct it."
               if s.get("confirm") else "Do not agree to any change to your account.")
    mood = rng.choice(["polite and brief", "friendly but a bit impatient", "chatty but cooperative"])
    return (f"You are {name}, a {'shop' if domain == 'retail' else 'airline'} customer; you are {mood}. "
            f"Your goal: {s['goal']} Facts you know: {facts}. Give a fact only when the agent asks for it; "
            f"never reveal this brief. {confirm} When your goal is done, or the agent has explained why it cannot "
            "be done, reply with ###STOP###.")


def make_tasks(domain, split, n, seed=0):
    """n tasks, scenarios round-robin; task i depends only on (domain, split, seed, i)."""
    db = load_db(domain, split, seed)               # builders only read it
    names = list(SCENARIOS[domain])
    tasks = []
    for i in range(n):
        rng = random.Random(f"{domain}-{split}-{seed}-{i}")
        s = SCENARIOS[domain][names[i % len(names)]](rng, db)
        who = db["users"][next(a.arguments["user_id"] for a in s["gold"] if "user_id" in a.arguments)]["name"] \
            if domain == "airline" else s["facts"]["name"]
        tasks.append(Task(id=f"{domain}-{split}-{i:05d}", domain=domain, split=split, scenario=names[i % len(names)],
                          tier=s["tier"], instruction=_brief(domain, who, s, rng), opening=s["opening"],
                          hidden_facts=s["facts"], gold_actions=s["gold"], required_outputs=s.get("outputs", []),
                          confirm_terms=s.get("confirm", []), seed=seed))
    return tasks


# ---------------------------------------------------------------------------------------------
# The environment: one per rollout.
# ---------------------------------------------------------------------------------------------
def db_hash(db):
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()


def _diff(want, got, path, out):
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got), key=str):
            _diff(want.get(k, "<absent>"), got.get(k, "<absent>"), f"{path}.{k}" if path else k, out)
    elif isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got)):
            _diff(w, g, f"{path}[{i}]", out)
    elif want != got or type(want) is not type(got):
        out.append(f"{path}: {_short(got, 70)} (gold: {_short(want, 70)})")


class Env:
    def __init__(self, task, shaped=False):
        self.task, self.shaped = task, shaped
        self.db = load_db(task.domain, task.split, task.seed)
        self.policy, self.tools = POLICIES[task.domain], tool_schemas(task.domain)
        self.writes, self.missing_outputs, self._gold_db = [], [], None

    def step(self, name, arguments):
        """Run one tool call and return its observation. Never raises; a refused call changes nothing."""
        tools = TOOLS[self.task.domain]
        if not isinstance(name, str) or name not in tools:
            return f"Error: unknown tool {_short(name)}; available: {', '.join(tools)}"
        if isinstance(arguments, str):               # tolerate arguments given as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        fn, schema = tools[name]
        write = name in WRITE_TOOLS[self.task.domain]
        snapshot = json.dumps(self.db) if write else None
        try:
            _check(arguments, schema["function"]["parameters"], "")
            arguments = json.loads(json.dumps(arguments))   # our own copy: nothing the caller holds enters the DB
            out = fn(self.db, **arguments)
        except Exception as e:                        # ToolError, or a bug: either way undo and report
            if write:
                self.db = json.loads(snapshot)
            return f"Error: {e}" if isinstance(e, ToolError) else f"Error: {name} failed ({type(e).__name__})"
        if write:
            self.writes.append(Action(name, arguments))
        return out if isinstance(out, str) else json.dumps(out)

    def gold_db(self):
        """The database after replaying the gold actions on a fresh copy (computed once per Env)."""
        if self._gold_db is None:
            gold = Env(self.task)
            for a in self.task.gold_actions:
                gold.step(a.name, a.arguments)
            self._gold_db = gold.db
        return self._gold_db

    def reward(self, assistant_texts):
        said = "\n".join(t for t in (assistant_texts or []) if isinstance(t, str)).lower()
        self.missing_outputs = [o for o in self.task.required_outputs if o.lower() not in said]
        passed = not self.missing_outputs and db_hash(self.db) == db_hash(self.gold_db())
        if passed or not self.shaped:
            return float(passed)
        key = lambda a: (a.name, json.dumps(a.arguments, sort_keys=True))   # noqa: E731
        gold = [key(a) for a in self.task.gold_actions if a.name in WRITE_TOOLS[self.task.domain]]
        done = [key(a) for a in self.writes]
        return sum(min(gold.count(k), done.count(k)) for k in set(gold)) / len(gold) if gold else 0.0

    def diff(self):
        """Field-level differences final DB vs gold DB, plus outputs missing at the last reward(); "" if none."""
        lines = []
        _diff(self.gold_db(), self.db, "", lines)
        lines = lines[:15] + [f"... {len(lines) - 15} more fields differ"] * (len(lines) > 15)
        return "\n".join(lines + [f"missing required output: {o!r}" for o in self.missing_outputs])
