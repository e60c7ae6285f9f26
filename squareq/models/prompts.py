"""Built-in calibration prompts: varied subjects, styles, lengths, and text rendering, as LoRA users write them."""

CALIBRATION_PROMPTS = (
    "a close-up portrait of an elderly fisherman with a weathered face, golden hour light, 85mm photo",
    "a neon-lit rainy street in Tokyo at night, reflections on wet asphalt, cinematic wide shot",
    "an oil painting of a stormy sea with a small lighthouse, thick impasto brush strokes",
    "a minimalist flat vector logo of a fox made of geometric shapes, orange and white",
    "a cozy reading nook with a cat asleep on a knitted blanket, soft morning light, film grain",
    "a hand-lettered chalkboard sign that says 'FRESH BREAD DAILY' outside a small bakery",
    "an astronaut riding a horse across a desert of red sand under two moons, concept art",
    "a macro photograph of dew drops on a spider web, shallow depth of field, bokeh",
    "a watercolor map of an imaginary island with mountains, rivers and tiny villages",
    "a product photo of a glass perfume bottle on black velvet, studio lighting, sharp focus",
    "anime style girl with silver hair and a red scarf standing in falling snow",
    "an isometric 3d render of a tiny futuristic city on a floating rock, pastel colors",
    "a black and white street photograph of children playing football in a narrow alley",
    "a medieval illuminated manuscript page with a dragon coiled around the letter Q",
    "a bowl of ramen with a soft-boiled egg, steam rising, top-down food photography",
    "a vast alpine landscape at sunrise, mist in the valleys, snow-capped peaks, 8k",
)
