"""envs/databases.py: the seeded, synthetic databases behind envs/ours.py's retail and airline domains.

load_db(domain, split, seed) returns a fresh copy of a split's DB as plain JSON-able dicts: users with
payment methods, and either orders over a small product catalogue (retail) or reservations on a
small flight network (airline). Both splits are generated in one pass from one seed, so their users
and ids never collide, while products and flights are shared. envs/ours.py's tools read and write these
dicts; its scenarios draw tasks from them. Imports nothing of ours.
"""
import itertools
import json
import random
from functools import lru_cache

TODAY = "2024-05-15"                          # fixed, so tasks and rewards never depend on the clock
SPLIT_USERS = {"train": 100, "test": 40}     # users per split DB; tasks resample them, so n is unbounded
INSURANCE_FEE, CABINS = 30, ["economy", "business"]


def money(x):
    return round(x + 0.0, 2)


FIRST = "Emma Liam Olivia Noah Ava Mason Sofia Lucas Mia Ethan Yara Omar Chen Priya Diego Lena Ivan Aisha Nora".split()
LAST = "Smith Garcia Kim Patel Nguyen Brown Lopez Rossi Cohen Silva Ito Novak Khan Moreau Berg Okafor Reyes".split()
STREETS = "Oak St,Maple Ave,Pine Rd,Cedar Ln,Elm St,Lake Dr,Hill Rd,Park Ave".split(",")
CITIES = [("Austin", "TX"), ("Denver", "CO"), ("Seattle", "WA"), ("Boston", "MA"), ("Chicago", "IL"), ("Miami", "FL")]
PRODUCTS = {  # product id -> name, option 1, option 2: 3 x 2 = 6 variants each
    "TEE": ("T-Shirt", ("color", "red blue black"), ("size", "S M")),
    "HAT": ("Sun Hat", ("color", "beige navy olive"), ("size", "S L")),
    "SHO": ("Running Shoes", ("color", "white grey red"), ("size", "9 10")),
    "LMP": ("Desk Lamp", ("color", "black white silver"), ("bulb", "LED halogen")),
    "BAG": ("Backpack", ("color", "green black blue"), ("size", "20L 30L")),
    "MUG": ("Travel Mug", ("color", "steel red white"), ("size", "12oz 16oz")),
}
AIRPORTS = {"JFK": "New York", "LAX": "Los Angeles", "SFO": "San Francisco", "ORD": "Chicago", "SEA": "Seattle",
            "MIA": "Miami"}
ROUTES = [("JFK", "LAX"), ("JFK", "SFO"), ("ORD", "SEA"), ("LAX", "SEA"), ("MIA", "JFK"), ("SFO", "ORD")]
DATES = [f"2024-05-{d}" for d in range(16, 26)]

def _uid(used, make):
    while (x := make()) in used:
        pass
    used.add(x)
    return x

def address(rng):
    city, state = rng.choice(CITIES)
    return dict(address1=f"{rng.randint(1, 999)} {rng.choice(STREETS)}", city=city, state=state,
                zip=str(rng.randint(10000, 99999)))

def _user(rng, used, kinds):
    first, last = rng.choice(FIRST), rng.choice(LAST)
    uid = _uid(used, lambda: f"{first}_{last}_{rng.randint(1000, 9999)}".lower())
    pms = [dict(id=_uid(used, lambda: f"{kind}_{rng.randint(1000, 9999)}"), type=kind,
                **({"balance": float(rng.randint(300, 600))} if kind in ("gift_card", "certificate") else {}))
           for kind in kinds]
    return dict(user_id=uid, name=f"{first} {last}", email=f"{first}.{last}{uid[-4:]}@example.com".lower(),
                address=address(rng), payment_methods={pm["id"]: pm for pm in pms})

def _catalog(rng):
    products = {}
    for pid, (name, (a1, v1), (a2, v2)) in PRODUCTS.items():
        sold_out, cents = rng.randrange(6), [rng.randrange(1500, 9000) for _ in range(6)]
        products[pid] = dict(product_id=pid, name=name, variants={    # prices never end in 0: "54.27" reads one way
            f"{pid}{k + 1:03d}": dict(item_id=f"{pid}{k + 1:03d}", options={a1: x, a2: y},
                                      price=(cents[k] + (cents[k] % 10 == 0)) / 100, available=k != sold_out)
            for k, (x, y) in enumerate(itertools.product(v1.split(), v2.split()))})
    return products

def _retail_split(rng, used, products, n_users):
    db = dict(users={}, orders={}, products=products)
    for _ in range(n_users):
        u = _user(rng, used, ["credit_card", "paypal", "gift_card"])
        db["users"][u["user_id"]], u["orders"] = u, []
        statuses = ["pending", "pending", "delivered", "delivered", rng.choice(["processed", "cancelled"])]
        for status in rng.sample(statuses, 5):
            oid = _uid(used, lambda: f"#W{rng.randint(1000000, 9999999)}")
            items = [dict(item_id=v["item_id"], product_id=p["product_id"], name=p["name"], options=v["options"],
                          price=v["price"]) for p in rng.sample(list(products.values()), rng.randint(1, 3))
                     for v in [rng.choice(list(p["variants"].values()))]]
            paid = dict(type="payment", amount=money(sum(i["price"] for i in items)),
                        payment_method_id=rng.choice(list(u["payment_methods"])[:2]))     # credit card or paypal
            db["orders"][oid] = dict(order_id=oid, user_id=u["user_id"], status=status, address=u["address"],
                                     items=items, payment_history=[paid])
            u["orders"].append(oid)
    return db

def _flights(rng):
    flights, used = {}, set()
    for a, b in ROUTES + [(b, a) for a, b in ROUTES]:
        for depart in sorted(rng.sample(["07:00", "10:30", "14:00", "18:45"], 2)):
            fn, base = _uid(used, lambda: f"MU{rng.randint(100, 999)}"), rng.randint(90, 300)
            flights[fn] = dict(flight_number=fn, origin=a, destination=b, depart=depart, dates={
                d: dict(prices=dict(economy=base + rng.randint(0, 60), business=3 * base + rng.randint(0, 150)),
                        seats=dict(economy=rng.randint(3, 30), business=rng.randint(2, 8))) for d in DATES})
    return flights

def _airline_split(rng, used, flights, n_users):
    db = dict(users={}, reservations={}, flights=flights, airports=AIRPORTS)
    for _ in range(n_users):
        u = _user(rng, used, ["credit_card", "gift_card", "certificate"][:rng.randint(2, 3)])
        u.update(dob=f"19{rng.randint(55, 99)}-0{rng.randint(1, 9)}-{rng.randint(10, 28)}", reservations=[],
                 membership=rng.choice(["regular", "silver", "gold"]))
        db["users"][u["user_id"]] = u
        first, last = u["name"].split()
        # one insured, one uninsured economy reservation, and a random third
        for insured, cabin in [(True, "economy"), (False, "economy"), (rng.random() < 0.5, rng.choice(CABINS))]:
            rid = _uid(used, lambda: "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ23456789", k=6)))
            f, date = rng.choice(list(flights.values())), rng.choice(DATES[:-1])
            companion = (rng.choice(FIRST), f"19{rng.randint(55, 99)}-11-0{rng.randint(1, 9)}")
            pax = [dict(first_name=name, last_name=last, dob=dob)
                   for name, dob in [(first, u["dob"]), companion][:rng.choice([1, 1, 2])]]
            paid = float(len(pax) * (f["dates"][date]["prices"][cabin] + INSURANCE_FEE * insured))
            db["reservations"][rid] = dict(
                reservation_id=rid, user_id=u["user_id"], origin=f["origin"], destination=f["destination"],
                flight_number=f["flight_number"], date=date, cabin=cabin, passengers=pax, insurance=insured,
                total_baggages=rng.randint(0, 1), status="active",
                payment_history=[dict(type="payment", amount=paid, payment_method_id=list(u["payment_methods"])[0])])
            u["reservations"].append(rid)
    return db

@lru_cache(maxsize=4)
def _db_json(domain, seed):
    """Both splits' DBs as JSON text (cached): every load is an independent copy."""
    rng, used = random.Random(f"{domain}-db-{seed}"), set()
    shared = _catalog(rng) if domain == "retail" else _flights(rng)     # products/flights: both splits
    make = _retail_split if domain == "retail" else _airline_split
    return {split: json.dumps(make(rng, used, shared, n)) for split, n in SPLIT_USERS.items()}

def load_db(domain, split, seed=0):
    """A fresh copy of the database the split's tasks live in."""
    return json.loads(_db_json(domain, seed)[split])
